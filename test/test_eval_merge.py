"""eval_merge: runs of one setting over disjoint seed ranges add up; failures are listed, never dropped."""
import json

import pytest

from vla_edge_ros.bench import eval_merge
from vla_edge_ros.bench.eval_grid import wilson_interval


def _row(successes, episodes, fresh, repeat, p99, admitted, misses, episode_s, task="push", backend="cuda",
         steps=80.0, new=1.0):
    return {"status": "ok", "error": None, "setting": {"task": task, "backend": backend},
            "episodes": episodes, "successes": successes, "episode_s": {"mean": episode_s},
            "steps_mean": steps, "new_plan_share": new,
            "runtime": {"ticks": {"fresh": fresh, "repeat": repeat, "hold": 0},
                        "chunks": {"admitted": admitted, "refused": 0, "deadline_misses": misses},
                        "latency_ms": {"p50": p99 / 2, "p99": p99}}}


def _run(tmp_path, name, rows):
    d = tmp_path / name
    d.mkdir()
    (d / "results.json").write_text(json.dumps({"meta": {}, "rows": rows}))
    return d


def test_group_name_strips_the_seed_suffix(tmp_path):
    assert eval_merge.group_of(tmp_path / "cuda-int8-push.s25") == "cuda-int8-push"
    assert eval_merge.group_of(tmp_path / "numpy-push") == "numpy-push"


def test_runs_of_a_group_add_up_and_failures_are_listed(tmp_path, capsys):
    a = _run(tmp_path, "cuda-bf16-push.s0", [_row(20, 25, 100, 300, 4.0, 100, 1, 8.0)])
    b = _run(tmp_path, "cuda-bf16-push.s25", [_row(22, 25, 50, 50, 6.0, 50, 0, 12.0, steps=120.0, new=0.5)])
    c = _run(tmp_path, "numpy-bf16-push.s0", [_row(10, 25, 10, 10, 30.0, 10, 0, 9.0, backend="numpy")])
    bad = _run(tmp_path, "cuda-int4-push.s0", [{"status": "failed", "error": "runtime died"}])
    missing = tmp_path / "cuda-fp8-push.s0"
    rc = eval_merge.main([str(tmp_path / "out"), str(a), str(b), str(c), str(bad), str(missing)])
    assert rc == 1
    doc = json.loads((tmp_path / "out" / "merged.json").read_text())
    rows = {r["group"]: r for r in doc["rows"]}
    cuda = rows["cuda-bf16-push"]
    assert (cuda["successes"], cuda["episodes"], cuda["runs"]) == (42, 50, 2)
    assert cuda["success_ci95"] == pytest.approx(list(wilson_interval(42, 50)))
    assert cuda["new_frame_share"] == pytest.approx((25 * 80 * 1.0 + 25 * 120 * 0.5) / (25 * 80 + 25 * 120))
    assert cuda["episode_s_mean"] == pytest.approx(10.0)
    assert cuda["latency_p99_ms_max"] == 6.0 and cuda["chunks_admitted"] == 150 and cuda["deadline_misses"] == 1
    assert rows["numpy-bf16-push"]["successes"] == 10
    reasons = " ".join(f["reason"] for f in doc["failures"])
    assert "runtime died" in reasons and "no readable results.json" in reasons
    printed = capsys.readouterr().out
    assert "42/50 (84 %)" in printed and printed.count("FAILED") == 2


def test_all_good_runs_exit_zero(tmp_path):
    a = _run(tmp_path, "g.s0", [_row(0, 5, 1, 1, 1.0, 1, 0, 1.0)])
    assert eval_merge.main([str(tmp_path / "o"), str(a)]) == 0
    assert "0/5 (0 %)" in (tmp_path / "o" / "merged.md").read_text()
