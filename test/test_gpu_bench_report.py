"""The GPU benchmark's report logic runs without a GPU: the speed-goal verdict of issue 4 and the report text,
on result dictionaries shaped like the benchmark's own JSON (figures here are made up, not measurements)."""
from __future__ import annotations

from vla_edge_ros.bench.gpu_chunk_bench import goal_verdict, print_report


def _res(median, p99, compiled_median=None):
    main = {"gpu_median_ms": median - 0.5, "gpu_p99_ms": p99 - 0.5, "host_median_ms": median, "host_p99_ms": p99,
            "prefill_median_ms": 1.0, "decode_median_ms": median - 1.5, "chunks": 100}
    res = {"device": "test", "geometry": "1.5b", "budget": 4096, "n_ctx": 4082, "geometry_layers": 28,
           "decode_tokens": 8, "copy_bandwidth_Bps": 4.2e12, "floor_ms": 5.8,
           "bytes": {"chunk": 24.6e9, "weights_per_pass": 2.62e9},
           "ours": {"main": main, "variants": {}, "kernel_ms": {"gemv": 1.0}, "peak_vram_bytes": 3 << 30,
                    "setup_s": 2.0}}
    if compiled_median is not None:
        res["hf_compiled"] = {"median_ms": compiled_median, "p99_ms": compiled_median + 1.0}
    return res


def test_verdict_meets_only_when_all_three_hold():
    assert [v for _, v in goal_verdict(_res(6.5, 7.5, 21.0))] == [True, True, True]
    assert [v for _, v in goal_verdict(_res(6.5, 8.5, 21.0))] == [True, False, True]      # p99 over 8 ms
    assert [v for _, v in goal_verdict(_res(6.9, 7.9, 20.0))] == [True, True, False]      # 2.9x < 3x
    assert [v for _, v in goal_verdict(_res(14.8, 14.9, 31.9))] == [False, False, False]  # where we stand
    assert [v for _, v in goal_verdict(_res(6.5, 7.5))] == [True, True, None]            # HF not measured
    assert goal_verdict({"ours": None}) == []


def test_report_prints_the_verdict(capsys):
    print_report(_res(6.5, 7.5, 21.0))
    out = capsys.readouterr().out
    assert "-> MET" in out and "NOT MET" not in out
    print_report(_res(6.5, 7.5))  # without HF compiled the goal cannot be called met
    out = capsys.readouterr().out
    assert "-> NOT MET" in out and "not measured" in out
