"""The closed loop really runs (issue 21, CI): vla_sim renders the arm, vla_runtime (the real nodes, numpy backend,
the embedded default) turns its frames into actions, the sim applies them and records episodes.

It asserts that the loop ran, not how well: images reached the runtime, the runtime produced fresh actions from
them, the sim applied received actions (fresh or repeat) and wrote one result per episode with its seed. The
success rate is the eval's business (a benchmark), not a unit test's."""
from __future__ import annotations

import json

import pytest

from ros_env import ROOT, read_json, wait_for

pytest.importorskip("rclpy")
import vla_edge_ros.sim  # noqa: E402,F401  selects MUJOCO_GL before mujoco is imported

pytest.importorskip("metaworld")

EPISODES, HORIZON = 2, 25


def test_sim_and_runtime_close_the_loop(tmp_path, ros_processes):
    results = tmp_path / "episodes.jsonl"
    rt_stats, sim_stats = tmp_path / "runtime.json", tmp_path / "sim.json"
    # A 5 Hz camera: the runtime's camera deadline must exceed the frame period or every gap reads as a stall.
    runtime = ros_processes.runtime("--params-file", str(ROOT / "config" / "runtime.yaml"), "-p", "backend:=numpy",
                                    "-p", "camera_deadline_ms:=1000.0", "-p", "stale_after_ms:=1000.0",
                                    stats_out=rt_stats)
    sim = ros_processes.start("vla_edge_ros.ros.sim_node", "--stats-out", str(sim_stats), "--ros-args",
                              "-p", "task:=reach", "-p", f"horizon:={HORIZON}", "-p", f"num_episodes:={EPISODES}",
                              "-p", "seed_start:=7", "-p", "control_hz:=10.0", "-p", "camera_hz:=5.0",
                              "-p", "image_width:=64", "-p", "image_height:=64", "-p", f"results_path:={results}")
    assert wait_for(lambda: not sim.alive(), 150.0), "sim did not finish its episodes:\n" + sim.output()[-3000:]
    assert sim.p.returncode == 0, sim.output()[-3000:]
    assert runtime.stop() == 0, runtime.output()[-3000:]
    lines = [json.loads(x) for x in results.read_text().splitlines() if x.strip()]
    assert [r["seed"] for r in lines] == [7, 8], lines
    for r in lines:
        assert r["task"] == "reach" and 1 <= r["steps"] <= HORIZON
        assert r["frames"] > 0, r  # the sim published images during the episode
        assert r["fresh"] + r["repeat"] > 0, r  # it applied actions it received from the runtime
        assert sum(r["rejected"].values()) == 0, r  # the runtime's JointState is what the sim expects
    stats = read_json(rt_stats)
    assert stats["frames"]["received"] > 0 and stats["frames"]["rejected"] == 0, stats["frames"]
    assert stats["chunks"]["admitted"] > 0 and stats["ticks"]["fresh"] > 0, (stats["chunks"], stats["ticks"])
