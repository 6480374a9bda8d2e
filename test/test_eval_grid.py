"""The pure parts of `vla_eval` without ROS: the Wilson interval, the setting grid, one row from episode JSON
lines + runtime stats, and the report (bench/eval_grid.py, bench/eval_report.py, bench/eval.py's flags)."""
from __future__ import annotations

import json
import math

import pytest

from vla_edge_ros import params as registry
from vla_edge_ros.bench import eval as vla_eval
from vla_edge_ros.bench.eval_grid import (Setting, aggregate, expand_grid, parse_budget, prefix_tokens,
                                          read_episode_lines, small_budget, wilson_interval)
from vla_edge_ros.bench.eval_report import TABLE_HEAD, make_plots, render_report, render_table
from vla_edge_ros.sim.episode import EpisodeResult
from vla_edge_ros.sim.tasks import TASKS


# ---- Wilson interval ---------------------------------------------------------------------------------------

def _score_test_bound(k: int, n: int, upper: bool, z: float = 1.959963984540054) -> float:
    """The p0 where the score test |k/n - p0| = z sqrt(p0 (1 - p0) / n) flips, found by bisection (an independent
    route to the Wilson interval: it is the set of p0 the score test does not reject)."""
    p = k / n
    lo, hi = (p, 1.0) if upper else (0.0, p)
    for _ in range(200):
        mid = (lo + hi) / 2
        rejected = abs(p - mid) > z * math.sqrt(mid * (1 - mid) / n)
        if upper:
            lo, hi = (lo, mid) if rejected else (mid, hi)
        else:
            lo, hi = (mid, hi) if rejected else (lo, mid)
    return (lo + hi) / 2


@pytest.mark.parametrize("k,n", [(0, 10), (1, 10), (5, 10), (9, 10), (10, 10), (37, 50), (1, 3)])
def test_wilson_interval_is_the_score_test_inversion(k, n):
    lo, hi = wilson_interval(k, n)
    assert lo <= k / n <= hi
    assert lo == pytest.approx(_score_test_bound(k, n, upper=False), abs=1e-9)
    assert hi == pytest.approx(_score_test_bound(k, n, upper=True), abs=1e-9)


def test_wilson_interval_edges_and_width():
    assert wilson_interval(0, 7)[0] == 0.0 and wilson_interval(7, 7)[1] == 1.0
    assert wilson_interval(10, 10)[0] > wilson_interval(5, 5)[0]  # more evidence, tighter bound
    w = [wilson_interval(n // 2, n) for n in (10, 40, 160)]
    assert w[0][1] - w[0][0] > w[1][1] - w[1][0] > w[2][1] - w[2][0]
    for bad in ((1, 0), (-1, 5), (6, 5)):
        with pytest.raises(ValueError):
            wilson_interval(*bad)


# ---- the grid ------------------------------------------------------------------------------------------------

def test_small_budget_evicts_after_a_few_frames():
    for task in TASKS:
        b = small_budget(task)
        prefix = len(TASKS[task].instruction.encode("utf-8"))
        assert prefix_tokens(task) == prefix
        assert b % 32 == 0 and (b - prefix) // 32 == 4  # four frames after the prefix ...
        assert (b - 32 - prefix) // 32 < 4  # ... and no smaller budget holds four
        assert registry.validate_all({"kv_budget_tokens": b}, prefix_tokens=prefix) == []
    assert parse_budget("small", "reach") == small_budget("reach") and parse_budget("0", "reach") == 0
    for bad in ("100", "abc", "16"):  # not a multiple of 32 / not a number / smaller than prefix + one frame
        with pytest.raises(ValueError):
            parse_budget(bad, "reach")


def test_grid_is_the_cross_product_plus_baselines_and_random_is_deduplicated():
    g = expand_grid(["reach", "push"], ["semantic", "fifo"], ["small", "0"], [33.0], [0.0, 50.0], ["numpy"])
    models = [s for s in g if s.kind == "model"]
    assert len(models) == 2 * 2 * 2 * 2  # tasks x policies x budgets x latencies
    assert len({s.key() for s in g}) == len(g)
    # no checkpoint: the random-weight baseline IS the first grid point of each task, run once, labelled both
    for task in ("reach", "push"):
        rnd = [s for s in g if s.task == task and s.baseline == "random"]
        assert len(rnd) == 1 and rnd[0] == next(s for s in models if s.task == task)
        assert rnd[0].inject_ms == 0 and "random-weight baseline" in rnd[0].label
        assert [s.kind for s in g if s.task == task and s.kind != "model"] == ["expert", "hold"]
    assert len(g) == 16 + 2 * 2
    assert {s.kv_budget_tokens for s in models if s.task == "reach"} == {0, small_budget("reach")}
    assert len({s.label for s in g}) == len(g) and len({s.slug for s in g}) == len(g)


def test_grid_with_a_checkpoint_adds_a_random_weight_row(tmp_path):
    g = expand_grid(["reach"], ["fifo"], ["0"], [33.0], [20.0], ["numpy"], ["random", "hold"], str(tmp_path))
    assert [(s.kind, s.checkpoint, s.inject_ms, s.baseline) for s in g] == [
        ("model", str(tmp_path), 20.0, ""), ("model", "", 0.0, "random"), ("hold", "", 0.0, "hold")]


@pytest.mark.parametrize("kwargs", [dict(baselines=["oracle"]), dict(policies=["lru"]), dict(backends=["tpu"]),
                                    dict(tasks=["fly"]), dict(deadlines=[0.0]), dict(latencies=[-5.0]),
                                    dict(policies=[])])
def test_grid_rejects_bad_flags(kwargs):
    args = dict(tasks=["reach"], policies=["semantic"], budgets=["0"], deadlines=[33.0], latencies=[0.0],
                backends=["numpy"]) | kwargs
    with pytest.raises(ValueError):
        expand_grid(**args)


def test_flags_quick_and_defaults():
    settings, cfg = vla_eval.build(vla_eval.parse_args(["--quick", "--baselines", "expert,hold"]))
    assert [s.kind for s in settings] == ["model", "expert", "hold"]
    assert (cfg.episodes, cfg.horizon, cfg.image_width, settings[0].task) == (2, 60, 64, "reach")
    assert cfg.camera_deadline_ms > 1000.0 / cfg.camera_hz and cfg.stale_after_ms > 1000.0 / cfg.camera_hz
    settings, cfg = vla_eval.build(vla_eval.parse_args(["--quick", "--episodes", "5", "--latencies", "0,20,50,100"]))
    assert cfg.episodes == 5 and sorted({s.inject_ms for s in settings if s.kind == "model"}) == [0, 20, 50, 100]
    assert vla_eval.main(["--quick", "--runtime-param", "no_such:=1", "--out", "/nonexistent/x"]) == 2
    assert vla_eval.main(["--quick", "--checkpoint", "/nonexistent/ckpt"]) == 2


def test_runtime_and_sim_parameters_carry_the_setting():
    s = Setting("model", "push", "numpy", "fifo", small_budget("push"), 40.0, 50.0)
    _, cfg = vla_eval.build(vla_eval.parse_args(["--quick"]))
    rt = vla_eval.runtime_overrides(s, cfg)
    assert rt[registry.INFERENCE]["instruction"] == TASKS["push"].instruction
    assert rt[registry.INFERENCE]["eviction_policy"] == "fifo" and rt[registry.INFERENCE]["deadline_ms"] == 40.0
    sim = vla_eval.sim_parameters(Setting("expert", "push"), cfg, "/tmp/e.jsonl")
    assert sim["sim_policy"] == "expert" and sim["num_episodes"] == cfg.episodes and sim["task"] == "push"
    assert vla_eval.sim_parameters(s, cfg, "/tmp/e.jsonl")["sim_policy"] == "external"
    assert sim["camera_after_control"] is False
    _, locked = vla_eval.build(vla_eval.parse_args(["--quick", "--camera-after-control"]))
    assert vla_eval.sim_parameters(s, locked, "/tmp/e.jsonl")["camera_after_control"] is True
    assert [vla_eval.domain_for(i, 230) for i in range(5)] == [230, 231, 232, 230, 231]


# ---- one row ---------------------------------------------------------------------------------------------------

def _episode(seed, success, steps, fresh, repeat, hold, sim_hold=0, policy="external", k=0, task="reach"):
    r = EpisodeResult(task=task, instruction=TASKS[task].instruction, seed=seed, episode=k, success=success,
                      end="success" if success else "horizon", steps=steps, horizon=60, duration_s=steps / 10.0,
                      fresh=fresh, repeat=repeat, hold=hold)
    r.sim_hold["no_action"] = sim_hold
    r.extra = {"sim_policy": policy}
    return json.loads(r.to_json())


def _stats(admitted=80, refused=20, misses=4, evictions=30, state="active"):
    return {"backend": "numpy", "chunks": {"admitted": admitted, "refused": refused, "deadline_misses": misses},
            "latency_ms": {"p50": 15.5, "p95": 20.0, "p99": 27.25},
            "kv": {"policy": "semantic", "budget_tokens": 160, "max_occupancy_tokens": 146},
            "frames": {"received": 100, "dropped": 0, "rejected": 0}, "ticks": {"fresh": 80, "repeat": 10, "hold": 5},
            "inference": {"state": state, "last_error": "boom" if state != "active" else "",
                          "kv": {"evictions": evictions}, "loop": {"retried": 7}}}


def test_aggregate_row_from_episodes_and_runtime_stats():
    s = Setting("model", "reach", kv_budget_tokens=small_budget("reach"))
    eps = [_episode(100, True, 40, 20, 18, 1, 1, k=0), _episode(101, False, 60, 30, 28, 2, 0, k=1),
           _episode(102, True, 50, 25, 20, 5, 0, k=2)]
    row = aggregate(s, eps, _stats(), expected=3, seed_start=100, logs="L")
    assert row["status"] == "ok" and row["error"] is None
    assert (row["successes"], row["episodes"]) == (2, 3) and row["success_rate"] == pytest.approx(2 / 3)
    assert row["success_ci95"] == pytest.approx(list(wilson_interval(2, 3)))
    steps = 150
    assert row["shares"] == pytest.approx({"fresh": 75 / steps, "repeat": 66 / steps, "hold": 8 / steps,
                                           "sim_hold": 1 / steps})
    assert row["episode_s"]["mean"] == pytest.approx(5.0) and row["success_steps_mean"] == pytest.approx(45.0)
    rt = row["runtime"]
    assert rt["latency_ms"] == {"p50": 15.5, "p99": 27.25} and rt["chunks"]["refused"] == 20
    assert rt["deadline_miss_rate"] == pytest.approx(4 / 80) and rt["refusal_rate"] == pytest.approx(20 / 100)
    assert rt["evictions_per_episode"] == pytest.approx(10.0) and rt["retried"] == 7 and row["kv_frames"] == 4
    assert row["jerk_sq_mean"] == 0.0  # the records' default (no motion recorded)
    for e, j in zip(eps, (3.0, 6.0, 30.0)):
        e["jerk_sq_mean"] = j
    assert aggregate(s, eps, _stats(), expected=3, seed_start=100)["jerk_sq_mean"] == pytest.approx(13.0)
    del eps[1]["jerk_sq_mean"]  # a line written before the field existed: no figure, not a wrong one
    assert aggregate(s, eps, _stats(), expected=3, seed_start=100)["jerk_sq_mean"] is None
    for e, k in zip(eps, (10, 20, 45)):
        e["new_plan"] = k
    assert aggregate(s, eps, _stats(), expected=3, seed_start=100)["new_plan_share"] == pytest.approx(75 / 150)
    del eps[2]["new_plan"]
    assert aggregate(s, eps, _stats(), expected=3, seed_start=100)["new_plan_share"] is None


@pytest.mark.parametrize("case,expect", [
    ("missing_episode", "only 1 of 2 episodes"), ("wrong_seeds", "seeds"), ("runtime_failed", "exited with 1"),
    ("no_stats", "no stats"), ("errored", "state 'errorprocessing'"), ("not_expert", "sim_policy"),
    ("bad_counts", "!= 40 steps"), ("wrong_task", "task(s) push")])
def test_aggregate_fails_a_row_and_keeps_it(case, expect):
    model, expert = Setting("model", "reach"), Setting("expert", "reach", baseline="expert")
    good = [_episode(5, True, 40, 39, 0, 0, 1, k=0), _episode(6, False, 40, 40, 0, 0, 0, k=1)]
    setting, eps, stats, failure = model, good, _stats(), None
    if case == "missing_episode":
        eps = good[:1]
    elif case == "wrong_seeds":
        eps = [good[1], good[0]]
    elif case == "runtime_failed":
        failure = "vla_runtime exited with 1 during the episodes (see x/runtime.log)"
    elif case == "no_stats":
        stats = None
    elif case == "errored":
        stats = _stats(state="errorprocessing")
    elif case == "not_expert":
        setting = expert  # episodes driven by received actions, not by the expert
    elif case == "bad_counts":
        eps = [good[0], _episode(6, False, 40, 10, 0, 0, 0, k=1)]
    elif case == "wrong_task":
        eps = [good[0], _episode(6, False, 40, 40, 0, 0, 0, k=1, task="push")]
    row = aggregate(setting, eps, stats, expected=2, seed_start=5, failure=failure, logs="logs/dir")
    assert row["status"] == "failed" and expect in row["error"], row["error"]
    assert row["episodes"] == len(eps) and row["logs"] == "logs/dir"
    table = render_table([row])
    assert "FAILED" in table and "logs/dir" in table


def test_episode_lines_report_bad_lines():
    good = json.dumps(_episode(1, True, 3, 3, 0, 0))
    eps, problems = read_episode_lines(f"{good}\n{{not json\n\n{json.dumps({'seed': 2})}\n{good}\n")
    assert len(eps) == 2 and len(problems) == 2
    assert "line 2" in problems[0] and "line 4 lacks success" in problems[1]
    row = aggregate(Setting("hold", "reach"), [], None, expected=1, seed_start=1, problems=problems)
    assert row["status"] == "failed" and "line 2" in row["error"] and row["success_rate"] is None


# ---- report --------------------------------------------------------------------------------------------------

def test_report_has_every_row_and_plots_are_written(tmp_path):
    rows = [aggregate(Setting("model", "reach", inject_ms=x), [_episode(9, x < 50, 40, 30, 10, 0)], _stats(),
                      1, 9, logs=f"l{x}") for x in (0.0, 50.0)]
    rows.append(aggregate(Setting("expert", "reach"), [_episode(9, True, 30, 30, 0, 0, policy="expert")], None,
                          1, 9, logs="le"))
    rows.append(aggregate(Setting("hold", "reach"), [], None, 1, 9, failure="vla_sim exited with 2", logs="lh"))
    doc = {"meta": {"config": {"episodes": 1, "seed_start": 9, "horizon": 60, "camera_hz": 5.0,
                               "image_width": 64, "image_height": 64, "control_hz": 10.0, "checkpoint": ""},
                    "machine": "test", "wall_s": 12.0, "command": "python -m vla_edge_ros.bench.eval --quick"},
            "rows": rows}
    md = render_report(doc)
    ncols = TABLE_HEAD.count("|")
    body = [line for line in md.splitlines() if line.startswith("| reach")]
    assert [line.split(" | ")[0][2:] for line in body] == [r["label"] for r in rows]
    # a label or an error never splits a row (escaped pipes do not count)
    assert all(line.replace("\\|", "").count("|") == ncols for line in body)
    assert "1/1 = 100 %" in body[0] and "0/1 = 0 %" in body[1] and "FAILED: vla_sim exited with 2" in body[3]
    assert "15.5 / 27.2" in body[0] and "1 setting(s) FAILED" in md and "--quick" in md
    paths = make_plots(rows, tmp_path)
    assert [p.name for p in paths] == ["success_vs_latency.png", "success_by_setting.png"]
    assert all(p.stat().st_size > 5000 for p in paths)
