"""`vla_eval --quick` for real (issue 21 part 5): vla_runtime + vla_sim processes for the random-weight model, and
vla_sim alone for the expert and hold baselines, 2 short reach episodes each, in wall-clock time.

It asserts that every setting ran and was measured, not how well the model did: every row is in results.json and
report.md, the expert's episodes applied the expert's actions (every step fresh, none held), the hold baseline's
held every step, the model's row carries the runtime's chunk figures, and each success rate is the share of
successful episode lines. Expert >= hold on reach is asserted: the expert solves seeds 100000 / 100001 in 50 / 42
steps (deterministic: synchronous and wall-clock runs take the same steps), a held arm never reaches the goal."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ros_env import apply_env

pytestmark = pytest.mark.ros_domains(3)  # vla_eval runs each of its 3 settings on its own domain from ros_domain on
pytest.importorskip("rclpy")
import vla_edge_ros.sim  # noqa: E402,F401  selects MUJOCO_GL before mujoco is imported

pytest.importorskip("metaworld")
pytest.importorskip("matplotlib")


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_quick_eval_runs_every_setting_through_real_processes(tmp_path, ros_domain):
    from vla_edge_ros.bench import eval as vla_eval

    apply_env(ros_domain, tmp_path / "ros_home")
    out = tmp_path / "eval"
    argv = ["--quick", "--baselines", "expert,hold", "--domain-id", str(ros_domain), "--out", str(out),
            "--no-progress"]
    expected, cfg = vla_eval.build(vla_eval.parse_args(argv))
    rc = vla_eval.main(argv)
    doc = json.loads((out / "results.json").read_text())
    rows = {r["setting"]["kind"]: r for r in doc["rows"]}
    assert rc == 0, [(r["label"], r["error"]) for r in doc["rows"]]
    assert [r["label"] for r in doc["rows"]] == [s.label for s in expected]
    assert sorted(rows) == ["expert", "hold", "model"]
    report = (out / "report.md").read_text()
    assert all(f"| {s.label} |" in report for s in expected)
    assert all((out / name).stat().st_size > 0 for name in ("success_vs_latency.png", "success_by_setting.png"))
    for kind, row in rows.items():
        eps = _lines(Path(row["logs"]) / "episodes.jsonl")
        assert [e["seed"] for e in eps] == [cfg.seed_start, cfg.seed_start + 1], kind
        assert row["status"] == "ok" and row["episodes"] == len(eps) == 2
        assert 0.0 <= row["success_rate"] <= 1.0
        assert row["success_rate"] == sum(e["success"] for e in eps) / len(eps)
        assert row["success_ci95"][0] <= row["success_rate"] <= row["success_ci95"][1]
        assert all(e["extra"]["sim_policy"] == ("external" if kind == "model" else kind) for e in eps)
        assert all(1 <= e["steps"] <= cfg.horizon and e["frames"] > 0 for e in eps)
    for e in _lines(Path(rows["expert"]["logs"]) / "episodes.jsonl"):  # the expert's own actions were applied
        assert e["fresh"] == e["steps"] and e["hold"] == e["repeat"] == sum(e["sim_hold"].values()) == 0, e
    for e in _lines(Path(rows["hold"]["logs"]) / "episodes.jsonl"):
        assert e["hold"] == e["steps"] and e["fresh"] == e["repeat"] == 0 and e["ee_end"] == pytest.approx(
            e["ee_start"], abs=0.01), e  # held: the hand stayed where it was
    model = rows["model"]
    assert model["runtime"]["chunks"]["admitted"] > 0 and model["runtime"]["latency_ms"]["p50"] > 0
    # the sim applied actions the runtime computed: steps whose action came from a newer frame (with the 30 Hz
    # publisher and 10 Hz control steps most new actions arrive as 'repeat' messages, so 'fresh' can be 0)
    assert model["new_plan_share"] > 0, model["shares"]
    assert model["kv_frames"] == 4 and model["runtime"]["kv"]["evictions"] > 0  # 'small': eviction in-episode
    assert rows["expert"]["success_rate"] >= rows["hold"]["success_rate"]
