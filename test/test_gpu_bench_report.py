"""The GPU benchmark's report logic runs without a GPU: the speed-goal verdict of issue 4 and the report text,
on result dictionaries shaped like the benchmark's own JSON (figures here are made up, not measurements), and the
profiling tools' recording launcher."""
from __future__ import annotations

from vla_edge_ros.bench.gpu_report import goal_verdict, print_report


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


def _decode_rows(names, gap, layers=28, steps=8):
    """Rows shaped like gpu_profile.timeline: a 3-kernel prefill, then per decode step embed, `names` per layer with
    release-to-release gaps `gap` (us), logits and argmax; every kernel started 3 us before its release, its last
    block released 0.5 us after its first."""
    rows, t = [("rmsnorm_rows_bf16", 0.0, 1.0, 2.0)] * 3, 10.0
    for _ in range(steps):
        for n, g in [("embed_gather", 1.0)] + [(n, g) for _ in range(layers) for n, g in zip(names, gap)] + \
                [("gemv_logits", 1.0), ("argmax_tokens", 1.0)]:
            rows.append((n, t - 3.0, t, t + 0.5))
            t += g
    return rows


def test_timeline_summary_attributes_each_gap_to_its_kernel():
    """Rows shaped like gpu_profile.timeline: each decode kernel's critical time is the gap from its release to the
    next kernel's release, averaged over the middle layers of steps 2..; o_proj and down are told apart."""
    from vla_edge_ros.bench.gpu_report import timeline_summary
    names = ["gemv_qkv", "attn_decode_hd128", "attn_combine", "gemv_resid", "gemv_gateup", "gemv_resid"]
    gap = [2.0, 8.0, 5.0, 1.0, 16.0, 6.5]
    got = {k: (crit, lead, spread, n) for k, crit, lead, spread, n in timeline_summary(_decode_rows(names, gap), 28)}
    assert set(got) == {"gemv_qkv", "attn_decode_hd128", "attn_combine", "gemv_resid o_proj", "gemv_gateup",
                        "gemv_resid down"}
    for k, g in zip(["gemv_qkv", "attn_decode_hd128", "attn_combine", "gemv_resid o_proj", "gemv_gateup",
                     "gemv_resid down"], gap):
        crit, lead, spread, n = got[k]
        assert abs(crit - g) < 1e-9 and abs(lead - 3.0) < 1e-9 and abs(spread - 0.5) < 1e-9
        assert n == 7 * 26  # steps 2..8, layers 1..26


def test_pf_phase_summary_names_the_slowest_blocks():
    """Per-block phase ends of the prefill attention: medians / maxima relative to the release, and the slowest
    blocks as (split, kv head), a block that never stored (NaN) last."""
    import numpy as np
    from vla_edge_ros.bench.gpu_report import PF_PHASES, pf_phase_summary
    nsplit, n_kvh, release = 4, 2, 100.0
    ph = np.tile(release + np.arange(1.0, 6.0), (nsplit * n_kvh, 1))  # every block: phase i ends at release + i + 1
    ph[3 + nsplit * 1, 1:] += 10.0  # split 3 of kv head 1: staging its own keys takes 10 us more
    ph[5, 2:] = np.nan  # a block that returned early (no phases after the first two)
    lines = pf_phase_summary(ph, release, nsplit, n_kvh, slowest=2)
    assert len(lines) == len(PF_PHASES) + 1
    assert "median    1.00  max    1.00  (n=8)" in lines[0]
    assert "median    2.00  max   12.00  (n=8)" in lines[1]
    assert "median    5.00  max   15.00  (n=7)" in lines[4]
    assert lines[-1].endswith("(3, 1: 15.00), (0, 0: 5.00)")

    # the token-split grid (z = 2): twice the blocks, named with their token half
    ph2 = np.concatenate([ph, ph + 0.5])
    assert pf_phase_summary(ph2, release, nsplit, n_kvh, slowest=2)[-1].endswith(
        "(split, kv head, z: stored at, us): (3, 1, 1: 15.50), (3, 1, 0: 15.00)")


def test_recording_launcher_forwards_only_the_families_asked_for():
    """The profiling tools' launcher records every launch in order and passes on only the families asked for (or
    none: dry), with the arguments and the serial flag untouched."""
    from vla_edge_ros.bench.gpu_profile import RecordingLauncher
    from vla_edge_ros.engine.cuda.plan import Launch
    got = []

    def inner(launch, *args, serial=False):
        got.append((launch.kernel, args, serial))
    seq = [Launch("gemv_qkv", (1, 1), (256, 1, 1)), Launch("attn_decode_hd128", (1, 1), (128, 1, 1)),
           Launch("attn_combine", (1, 1), (256, 1, 1)), Launch("attn_decode_hd64", (1, 1), (128, 1, 1))]
    for only, skip, dry, want in ((None, (), False, [0, 1, 2, 3]), ({"attn_decode"}, (), False, [1, 3]),
                                  (None, {"attn_decode"}, False, [0, 2]), (None, (), True, [])):
        got.clear()
        rec = RecordingLauncher(inner, only=only, skip=skip, dry=dry)
        for i, launch in enumerate(seq):
            rec(launch, i, 2.5, serial=i == 0)
        assert rec.names == [s.kernel for s in seq]
        assert got == [(seq[i].kernel, (i, 2.5), i == 0) for i in want] and rec.forwarded == len(want)
