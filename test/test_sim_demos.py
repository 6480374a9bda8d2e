"""sim/demos.py on the real MetaWorld: expert episodes of reach land in one bag in the OXE converter's layout,
stamped at the control rate, with what the sim node would publish; failures are counted, not written; the bag
does not depend on the number of worker processes."""
from __future__ import annotations

import json

import numpy as np
import pytest

import vla_edge_ros.sim  # noqa: F401  first: it selects MUJOCO_GL=egl before mujoco is imported

pytest.importorskip("metaworld")
pytest.importorskip("rosbags")

from vla_edge_ros.data.bag_reader import read_episodes  # noqa: E402
from vla_edge_ros.sim import demos  # noqa: E402
from vla_edge_ros.sim.metaworld_env import MetaWorldSim  # noqa: E402
from vla_edge_ros.sim.tasks import TASKS  # noqa: E402

SPEC = demos.DemoSpec(width=64, height=32)  # small frames: the test pays the render


def test_two_reach_demos_in_one_bag(tmp_path):
    bag = tmp_path / "reach"
    s = demos.record_demos(bag, ["reach"], episodes=2, seed_start=5, spec=SPEC, workers=1, progress=False)
    assert (s.attempted, s.kept, s.failed_seeds) == (2, 2, {})
    assert s.frames > 20 and s.demos_per_s > 0 and s.bag_bytes > s.frames * 64 * 32 * 3
    assert s.messages["/camera/image_raw"] == s.messages["/vla/recorded_action"] == s.frames
    assert s.messages["/vla/instruction"] == 2
    assert set(s.messages) == {"/camera/image_raw", "/vla/recorded_action", "/vla/instruction",
                               "/vla/episode_events"}
    episodes, read = read_episodes(bag)
    assert not read.skipped and [e.start["seed"] for e in episodes] == [5, 6]
    assert sum(e.steps for e in episodes) == s.frames
    assert read.messages["/vla/episode_events"] == 4 + sum(  # start + end, plus any gripper crossing
        int(np.sum(np.diff(e.actions[:, 6] >= 0.5) != 0)) for e in episodes)
    for e in episodes:
        assert e.success is True and e.end["end"] == "success" and e.end["seed"] == e.start["seed"]
        assert e.instruction == TASKS["reach"].instruction and e.start["task"] == "reach"
        assert (e.start["width"], e.start["height"], e.start["camera"]) == (64, 32, "corner")
        assert e.frames.shape == (e.steps, 32, 64, 3) and e.frames.std() > 5
        assert np.diff(e.stamps_ns).tolist() == [100_000_000] * (e.steps - 1)  # vla_sim's control_hz 10
        assert np.all(np.abs(e.actions[:, :3]) <= 0.01 + 1e-12)  # metres per step, inside the mapping's range
        np.testing.assert_array_equal(e.actions[:, 3:6], 0.0)  # MetaWorld does not rotate
    # frame 0 is what the sim node renders after reset(seed), and the actions replay to success
    sim = MetaWorldSim("reach", SPEC.camera, SPEC.width, SPEC.height, SPEC.horizon)
    try:
        sim.reset(6)
        np.testing.assert_array_equal(sim.render(), episodes[1].frames[0])
        ok = [sim.step_env(sim.mapping.to_env(a)) for a in episodes[1].actions]
        assert ok[-1] and not any(ok[:-1])
    finally:
        sim.close()


def test_failed_expert_episodes_are_counted_and_dropped_unless_kept(tmp_path):
    short = demos.DemoSpec(width=32, height=16, horizon=4)  # too short for the expert to succeed
    s = demos.record_demos(tmp_path / "a", ["reach"], episodes=2, seed_start=0, spec=short, progress=False)
    assert (s.attempted, s.kept, s.frames, s.failed_seeds) == (2, 0, 0, {"reach": [0, 1]})
    assert "2 expert failures" in s.text()
    s = demos.record_demos(tmp_path / "b", ["reach"], episodes=2, seed_start=0, spec=short, keep_failed=True,
                           progress=False)
    assert (s.kept, s.frames) == (2, 8)
    episodes, _ = read_episodes(tmp_path / "b")
    assert [(e.success, e.end["end"], e.steps) for e in episodes] == [(False, "horizon", 4)] * 2


def test_workers_give_the_same_bag(tmp_path):
    short = demos.DemoSpec(width=32, height=16, horizon=6)
    kw = dict(tasks=["reach", "push"], episodes=2, seed_start=3, spec=short, keep_failed=True, progress=False)
    one = demos.record_demos(tmp_path / "one", workers=1, **kw)
    two = demos.record_demos(tmp_path / "two", workers=2, **kw)
    assert one.messages == two.messages and one.frames == 24
    a, _ = read_episodes(tmp_path / "one")
    b, _ = read_episodes(tmp_path / "two")
    assert [(e.start["task"], e.start["seed"]) for e in a] == [("reach", 3), ("reach", 4), ("push", 3), ("push", 4)]
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.frames, y.frames)
        np.testing.assert_array_equal(x.actions, y.actions)
        assert x.stamps_ns.tolist() == y.stamps_ns.tolist() and x.start == y.start


def test_cli(tmp_path, capsys):
    out = tmp_path / "bag"
    args = [str(out), "--tasks", "reach", "--episodes", "1", "--workers", "1", "--width", "32", "--height", "16",
            "--horizon", "3", "--keep-failed", "--no-progress", "--summary-json", str(tmp_path / "s.json")]
    assert demos.main(args) == 0
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["kept"] == 1 and summary["frames"] == 3 and summary["demos_per_s"] > 0
    assert "demos/s" in capsys.readouterr().out
    assert demos.main(args) == 2 and "exists" in capsys.readouterr().err
    assert demos.main([str(tmp_path / "c"), "--horizon", "3", "--episodes", "1", "--workers", "1",
                       "--no-progress"]) == 1  # nothing kept: an error exit
