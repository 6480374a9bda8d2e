"""Sweep figures, report and plots from runtime stats (no ROS processes started here)."""
import json

import numpy as np
import pytest

from vla_edge_ros.bench import sweep


def runtime_stats(admitted, refused, misses, fresh, repeat, hold, policy="fifo", state="active", saliency=None):
    """The shape of `vla_runtime --stats-out` (keys as in ros/runtime.py Runtime.stats)."""
    st = {"backend": "numpy", "duration_s": 10.0,
          "ticks": {"fresh": fresh, "repeat": repeat, "hold": hold},
          "chunks": {"admitted": admitted, "refused": refused, "deadline_misses": misses},
          "latency_ms": {"p50": 10.0, "p95": 20.0, "p99": 30.0},
          "kv": {"policy": policy, "budget_tokens": 4096, "max_occupancy_tokens": 2048},
          "frames": {"received": 600, "dropped": 300, "rejected": 2},
          "memory": {"peak_rss_mb": 150.0, "peak_vram_mb": 0.0},
          "inference": {"state": state, "last_error": "boom" if state != "active" else "",
                        "latency_ms": {"max": 40.0}, "kv": {"occupancy_tokens": 2048}}}
    if saliency is not None:
        st["inference"]["kv_manager"] = {"saliency": saliency}
    return st


def test_summarise_rates_and_memory():
    timeline = [{"t_s": 0.25, "rss_mb": 120.0}, {"t_s": 0.5, "rss_mb": 210.0, "kv_occupancy_tokens": 64}]
    sal = {"salient_seen": 4, "retention": {"1": {"matured": 4, "retained": 4, "fraction": 1.0},
                                            "8": {"matured": 4, "retained": 1, "fraction": 0.25}}}
    r = sweep.summarise("fifo", "nominal", {"eviction_policy": "fifo"},
                        runtime_stats(80, 20, 4, fresh=60, repeat=30, hold=10, saliency=sal),
                        {"camera_ticks": 620}, timeline, {"mae": 0.5}, 0)
    assert r["error"] is None
    assert r["deadline_miss_rate"] == pytest.approx(4 / 80)
    assert r["refusal_rate"] == pytest.approx(20 / 100)
    assert (r["fresh_rate"], r["fallback_rate"], r["hold_rate"]) == pytest.approx((0.6, 0.3, 0.1))
    assert r["memory"]["peak_rss_mb"] == 210.0  # the sampled peak beats the runtime's own 150
    assert r["memory"]["peak_fraction_of_ceiling"] == pytest.approx(210.0 / 8192, abs=1e-4)
    assert r["frames"]["dropped_in_transport"] == 20 and r["frames"]["overwritten_before_inference"] == 300
    assert sweep.retention_at(r, 8) == 0.25 and sweep.retention_at(r, 64) is None
    assert r["latency_ms"]["max"] == 40.0


def test_failed_runs_are_flagged():
    r = sweep.summarise("fifo", "stressed", {}, runtime_stats(0, 0, 0, 0, 0, 30, state="unconfigured"), {}, [],
                        None, 0)
    assert "unconfigured" in r["error"] and "boom" in r["error"]
    r = sweep.summarise("fifo", "stressed", {}, runtime_stats(0, 0, 0, 0, 0, 30), {}, [], None, 0)
    assert "no chunk" in r["error"]


def test_latency_curve_from_samples_or_percentiles():
    r = {"latency_samples_ms": [3.0, 1.0, 2.0], "latency_ms": {}}
    x, y = sweep.latency_curve(r)
    assert x.tolist() == [1.0, 2.0, 3.0] and y[-1] == 1.0
    x, y = sweep.latency_curve({"latency_ms": {"p50": 5.0, "p95": 9.0, "p99": None, "max": 12.0}})
    assert x.tolist() == [0.0, 5.0, 9.0, 12.0] and y.tolist() == [0.0, 0.5, 0.95, 1.0]


def test_report_and_plots(tmp_path):
    results = {}
    for setting in ("nominal", "long_context"):
        for i, policy in enumerate(sweep.POLICIES):
            st = runtime_stats(50 + i, 10 * i, i, 40, 10, 5 + i, policy=policy)
            tl = [{"t_s": t / 4, "rss_mb": 100.0 + t, "kv_occupancy_tokens": 32 * t} for t in range(8)]
            results.setdefault(setting, {})[policy] = sweep.summarise(policy, setting, {"deadline_ms": 33.0}, st,
                                                                      {"camera_ticks": 700}, tl, None, 0)
    results["long_context"]["fifo"]["error"] = "vla_inference ended in state 'unconfigured'"
    table = sweep.report_table(results)
    rows = table.splitlines()
    assert len(rows) == 2 + 6 and rows[1].count("---") == rows[0].count("|") - 1
    assert "| nominal | semantic | 50 | 0 |" in table and "FAILED" in table
    paths = sweep.make_plots(results, tmp_path)
    assert [p.name for p in paths] == ["latency_cdf.png", "rates.png", "memory.png", "saliency.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000 for p in paths)
    meta = {"bag": "b", "bag_description": "synthetic", "camera_hz": 60.0, "duration": 5.0, "backend_used": "numpy",
            "machine": "test", "command": "make sweep DURATION=5"}
    report = sweep.write_report(results, tmp_path, meta).read_text()
    assert table in report and "make sweep DURATION=5" in report


def test_params_file_is_validated(tmp_path):
    doc = sweep.write_params(tmp_path / "p.yaml", "semantic", sweep.SETTINGS["long_context"], "numpy", "", "go")
    assert doc["kv_budget_tokens"] % 32 == 0 and doc["instruction"] == "go"
    import yaml

    loaded = yaml.safe_load((tmp_path / "p.yaml").read_text())
    assert loaded["vla_inference"]["ros__parameters"]["eviction_policy"] == "semantic"
    with pytest.raises(ValueError, match="not a multiple"):
        sweep.write_params(tmp_path / "q.yaml", "fifo", {"kv_budget_tokens": 1000}, "numpy", "", None)


def test_weight_dtype_reaches_the_params_file(tmp_path):
    """--weight-dtype (issue 23's replay per weight type) is one more inference parameter, validated as the rest."""
    doc = sweep.write_params(tmp_path / "p.yaml", "semantic", {**sweep.SETTINGS["nominal"], "weight_dtype": "int4"},
                             "cuda", "/ckpt", None)
    import yaml

    assert yaml.safe_load((tmp_path / "p.yaml").read_text())["vla_inference"]["ros__parameters"]["weight_dtype"] == "int4"
    assert doc["backend"] == "cuda"
    with pytest.raises(ValueError, match="weight_dtype"):
        sweep.write_params(tmp_path / "q.yaml", "fifo", {"weight_dtype": "int3"}, "numpy", "", None)
    with pytest.raises(SystemExit):  # argparse refuses a weight type the registry does not know
        sweep.main(["--weight-dtype", "int3"])


@pytest.mark.parametrize("shared", [True, False])
def test_default_bag_is_a_readable_clip(tmp_path, monkeypatch, shared):
    if not shared:  # as on a machine without ../shared: the synthetic clip
        monkeypatch.setattr(sweep, "SHARED_OXE", tmp_path / "absent")
    elif not (sweep.SHARED_OXE / "bridge_dataset").is_dir():
        pytest.skip("../shared/data/oxe not present")
    bag, desc = sweep.default_bag(tmp_path)
    assert (bag / "metadata.yaml").is_file()
    instruction = sweep.first_instruction(bag)
    assert isinstance(instruction, str) and instruction
    assert ("real Bridge" in desc) == (sweep.SHARED_OXE / "bridge_dataset").is_dir()


def test_main_runs_every_setting_and_writes_the_report(tmp_path, monkeypatch, capsys):
    """main()'s own loop (its per-run line, the JSON and the report) with run_once replaced by a canned result: the
    H200 replays of session 18 lost their summaries to a NameError in that line, after the runtime had run."""
    calls = []

    def fake_run_once(bag, policy, setting, duration, out_dir, env, backend, checkpoint, instruction, listener,
                      camera_hz, startup_timeout, extra=None):
        calls.append((policy, setting, backend, extra))
        return sweep.summarise(policy, setting, {"eviction_policy": policy, **(extra or {})},
                               runtime_stats(80, 20, 4, fresh=60, repeat=30, hold=10, policy=policy),
                               {"camera_ticks": 620}, [], None, 0)

    monkeypatch.setattr(sweep, "run_once", fake_run_once)
    monkeypatch.setattr(sweep, "first_instruction", lambda bag: "go")
    bag = tmp_path / "bag"
    bag.mkdir()
    rc = sweep.main(["--bag", str(bag), "--out", str(tmp_path / "out"), "--policies", "semantic,fifo", "--settings",
                     "nominal", "--backend", "numpy", "--weight-dtype", "int8", "--no-listener"])
    assert rc == 0
    assert calls == [("semantic", "nominal", "numpy", {"weight_dtype": "int8"}),
                     ("fifo", "nominal", "numpy", {"weight_dtype": "int8"})]
    out = capsys.readouterr().out
    assert "admitted 80 refused 20 misses 4 p99 30.0 ms" in out
    doc = json.loads((tmp_path / "out" / "fifo.json").read_text())
    assert doc["settings"]["nominal"]["params"]["weight_dtype"] == "int8"
    assert (tmp_path / "out" / "report.md").exists()


def test_wait_active_reads_the_runtime_log(tmp_path):
    """The replay starts only once the runtime logs that inference is active; a runtime that exits first, or
    never gets there, is a reason, not a hang."""
    import sys

    from vla_edge_ros.bench.procs import ACTIVE_LINE, Child, wait_active

    env = {"PATH": "/usr/bin:/bin"}
    ok = Child([sys.executable, "-c", f"import time; time.sleep(0.3); print({ACTIVE_LINE!r}, flush=True); "
                "time.sleep(5)"], env, tmp_path / "ok.log", name="runtime")
    try:
        assert wait_active(ok, 10.0, poll_s=0.05) is None
    finally:
        ok.stop(5)
    dead = Child([sys.executable, "-c", "raise SystemExit(3)"], env, tmp_path / "dead.log", name="runtime")
    assert "exited with 3" in wait_active(dead, 10.0, poll_s=0.05)
    slow = Child([sys.executable, "-c", "import time; time.sleep(5)"], env, tmp_path / "slow.log", name="runtime")
    try:
        assert "not active after 0 s" in wait_active(slow, 0.3, poll_s=0.05)
    finally:
        slow.stop(5)
