"""The 60-second soak (CI): `python -m vla_edge_ros.bench.soak --duration 60` must pass its limits.

The one test allowed to take more than a minute (~80 s: start-up, 10 s warm-up, 60 s measured). It runs the
soak script exactly as `make soak` does (child processes: test camera at 60 Hz, vla_runtime; ticks counted by
the script's own subscriber), with a small KV budget so the numpy backend keeps producing fresh actions on
2 shared cores and the cache evicts on every chunk (the churn a leak would show in). Limits: the script's own
RSS (< 5 %) and KV (never over budget) limits unchanged; for a loaded 2-core CI machine, up to 1 % of ticks
missing and a longest gap below 6 periods (200 ms) instead of 0 and 2 periods (the 30-minute reference run
uses the strict defaults). The JSON is then checked here as well.
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("rclpy")
DURATION_S = 60


@pytest.mark.slow
def test_soak_60s_within_limits(tmp_path, ros_processes):
    out = tmp_path / "soak.json"
    expected_ticks = DURATION_S * 30
    # the soak script starts the camera and the runtime itself, in the environment it is given (this domain)
    p = ros_processes.run("vla_edge_ros.bench.soak", "--duration", DURATION_S, "--warmup-s", "10", "--out", out,
                          "--keep-logs", tmp_path / "logs",
                          "--param", "backend:=numpy",  # kv_budget_tokens: the numpy default (512), asserted below
                          # CI machines are shared and this window is short: looser tick and gap limits than the
                          # soak's own defaults (0 missed ticks, 2 periods) and no miss-rate limit (0.1 %): the
                          # chunk's cost on a 2-core CPU is a benchmark figure (make soak, docs/FIGURES.md), this
                          # test checks that the loop and its figures run.
                          "--max-missed-ticks", expected_ticks // 100, "--max-gap-periods", "6",
                          "--max-miss-pct", "100", timeout_s=DURATION_S + 200)
    print(p.stdout[-3000:])
    assert p.returncode == 0, (p.returncode, p.stdout[-3000:], p.stderr[-3000:])
    r = json.loads(out.read_text())
    for key in ("rss_growth_pct", "vram_growth_pct", "kv_max_occupancy_tokens", "kv_budget_tokens",
                "ticks_expected", "ticks_published", "longest_tick_gap_ms", "deadline_misses"):
        assert key in r, key
    assert r["violations"] == [] and r["runtime_exit_code"] == 0
    assert r["limits"]["max_miss_pct"] == 100.0 and 0.0 <= r["deadline_miss_pct"] <= 100.0, r
    assert abs(r["duration_s"] - DURATION_S) < 2.0
    assert 0.97 * expected_ticks <= r["ticks_expected"] <= 1.01 * expected_ticks, r["ticks_expected"]
    assert r["ticks_published"] >= 0.99 * r["ticks_expected"], r
    assert r["longest_tick_gap_ms"] < 200.0, r
    assert r["rss_growth_pct"] is not None and r["rss_growth_pct"] < 5.0, r
    assert r["backend"] == "numpy" and r["vram_growth_pct"] is None and "no device memory" in r["vram_note"]
    assert r["kv_budget_tokens"] == 512 and 0 < r["kv_max_occupancy_tokens"] <= 512, r
    # the window exercised inference, not just holds: fresh actions and chunks throughout
    assert r["ticks_by_kind"]["fresh"] >= 0.02 * r["ticks_published"], r["ticks_by_kind"]  # inference ran
    assert r["chunks_admitted"] >= DURATION_S, r
    assert r["frames_rejected"] == 0
