"""The PDL hop benchmark's CPU-side pieces: the chain's expected result (its validation) and the report."""
from __future__ import annotations

import pytest

from vla_edge_ros.bench.pdl_hop_bench import BOUNDARIES_PER_CHUNK, copy_expected, main, report


def _simulate(hops: int, replays: int) -> list[float]:
    buf = [0.0, 0.0]
    for _ in range(replays):
        for k in range(hops):
            buf[(k + 1) % 2] = buf[k % 2] + 1
    return buf


@pytest.mark.parametrize("hops,replays", [(2, 1), (224, 51), (10, 3)])
def test_copy_expected_matches_a_simulated_chain(hops, replays):
    idx, want = copy_expected(0.0, hops, replays)
    assert _simulate(hops, replays)[idx] == want


def test_copy_expected_refuses_odd_chains():
    with pytest.raises(ValueError, match="even"):
        copy_expected(0.0, 3, 1)


def test_report_scales_a_hop_to_the_chunks_boundaries():
    assert BOUNDARIES_PER_CHUNK == 1344
    lines = report([{"kernel": "hop_vector", "blocks": 132, "pdl": True, "us_per_hop": 2.5},
                    {"kernel": "hop_copy", "blocks": 6, "pdl": False, "us_per_hop": 4.0}])
    assert len(lines) == 3
    assert lines[1].split() == ["hop_vector", "132", "PDL", "2.50", "3.36"]
    assert lines[2].split() == ["hop_copy", "6", "plain", "4.00", "5.38"]


def test_odd_hop_counts_are_refused_before_any_gpu_work(capsys):
    with pytest.raises(SystemExit):
        main(["--hops", "3"])
    assert "even" in capsys.readouterr().err


def test_without_a_usable_gpu_it_says_why_and_exits_2(capsys):
    from vla_edge_ros.engine.cuda.probe import cuda_status
    if cuda_status()[0]:
        pytest.skip("a usable GPU is present")
    assert main(["--hops", "4"]) == 2
    assert "pdl_hop_bench: no usable GPU" in capsys.readouterr().err
