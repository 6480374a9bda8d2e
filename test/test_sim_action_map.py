"""sim/action_map.py and sim/episode.py without MetaWorld: the 7 <-> 4 mapping, the action gate, the controller."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from vla_edge_ros.engine.config import DEFAULT_ACTION_NAMES
from vla_edge_ros.sim.action_map import (GRIPPER, RUNTIME_ACTION_NAMES, ActionMapping, ActionRejected, kind_of,
                                         parse_command)
from vla_edge_ros.sim.episode import EpisodeResult, SimController

M = ActionMapping(0.01)


def test_runtime_names_are_the_engines():
    assert RUNTIME_ACTION_NAMES == tuple(DEFAULT_ACTION_NAMES) and RUNTIME_ACTION_NAMES[GRIPPER] == "gripper"


def test_to_env_units_gripper_convention_and_clipping():
    a = [0.005, -0.002, 0.0, 0.3, 0.0, 0.0, 1.0]  # 5 mm, -2 mm, open
    np.testing.assert_allclose(M.to_env(a), [0.5, -0.2, 0.0, -1.0])
    np.testing.assert_allclose(M.to_env([0, 0, 0, 0, 0, 0, 0.0])[3], 1.0)  # closed -> MetaWorld +1 (close)
    np.testing.assert_allclose(M.to_env([0.05, -0.05, 0, 0, 0, 0, 2.0]), [1.0, -1.0, 0.0, -1.0])
    assert M.saturated([0.05, 0, 0, 0, 0, 0, 0.5]) and not M.saturated([0.01, 0, 0, 0, 0, 0, 0.5])
    assert M.rotation_ignored(a) and not M.rotation_ignored([0.01, 0, 0, 0, 0, 0, 1.0])


def test_env_to_runtime_to_env_round_trip_is_what_the_env_applies():
    rng = np.random.default_rng(0)
    for env4 in rng.uniform(-1.5, 1.5, size=(200, 4)):
        a7 = M.from_env(env4)
        assert a7.shape == (7,) and np.all(a7[3:6] == 0.0)
        np.testing.assert_allclose(M.to_env(a7), np.clip(env4, -1, 1), atol=1e-12)
    # and the other way for actions inside the env's range
    for a7 in rng.uniform([-.01, -.01, -.01, 0, 0, 0, 0], [.01, .01, .01, 0, 0, 0, 1], size=(50, 7)):
        np.testing.assert_allclose(M.from_env(M.to_env(a7)), a7, atol=1e-12)


def test_hold_keeps_the_gripper_and_does_not_move():
    np.testing.assert_array_equal(M.hold_env(0.6), [0.0, 0.0, 0.0, 0.6])


@pytest.mark.parametrize("frame_id, values, names, reason", [
    ("fresh", [0.0] * 6, [], "wrong_length"),
    ("fresh", [0.0] * 8, [], "wrong_length"),
    ("fresh", [0, 0, math.nan, 0, 0, 0, 1], [], "non_finite"),
    ("repeat", [0, 0, 0, math.inf, 0, 0, 1], [], "non_finite"),
    ("fresh", [0.0] * 7, ["y", "x", "z", "roll", "pitch", "yaw", "gripper"], "names_mismatch"),
    ("", [0.0] * 7, [], "unknown_kind"),
    ("go", [0.0] * 7, [], "unknown_kind"),
    ("fresh", ["a"] * 7, [], "not_numeric"),
])
def test_gate_rejects_with_a_reason(frame_id, values, names, reason):
    with pytest.raises(ActionRejected) as exc:
        parse_command(frame_id, values, names)
    assert exc.value.reason == reason


def test_gate_accepts_kinds_and_positional_names():
    assert kind_of("fresh:17") == "fresh"
    kind, a = parse_command("hold", [0, 0, 0, 0, 0, 0, 1], RUNTIME_ACTION_NAMES)
    assert kind == "hold" and a.dtype == np.float64 and a[6] == 1.0
    assert parse_command("repeat", [0.0] * 7, [])[0] == "repeat"


class FakeSim:
    """The env interface SimController drives; succeeds after ``succeed_after`` steps (never when None)."""
    task, instruction, mapping = "fake", "do it", M

    def __init__(self, horizon: int = 5, succeed_after=None):
        self.horizon, self.succeed_after = horizon, succeed_after
        self.applied: list[np.ndarray] = []
        self.seeds: list[int] = []
        self.pos = np.zeros(3)

    def reset(self, seed):
        self.seeds.append(seed)
        self.pos, self.steps = np.zeros(3), 0

    def step_env(self, a4):
        self.applied.append(np.array(a4))
        self.pos = self.pos + np.asarray(a4[:3]) * 0.01
        self.steps += 1
        return self.succeed_after is not None and self.steps >= self.succeed_after

    def ee_position(self):
        return self.pos


class Clock:
    def __init__(self):
        self.ns = 0

    def __call__(self):
        return self.ns


def test_controller_applies_newest_holds_on_rejection_staleness_and_silence():
    sim, clock = FakeSim(horizon=100), Clock()
    ctl = SimController(sim, action_timeout_ms=100.0, clock_ns=clock)
    ctl.control_step()  # nothing received yet
    np.testing.assert_array_equal(sim.applied[-1], [0, 0, 0, -1])  # hold, hand open as reset
    assert ctl.offer("fresh", [0.001, 0, 0, 0, 0, 0, 0.0]) is None  # newer one below wins
    assert ctl.offer("repeat", [0.002, 0, 0, 0, 0, 0, 0.0]) is None
    ctl.control_step()
    np.testing.assert_allclose(sim.applied[-1], [0.2, 0, 0, 1.0])
    assert ctl.offer("fresh", [0.0] * 6) == "wrong_length"
    ctl.control_step()  # the rejected message is not applied, and the older good one is not reused
    np.testing.assert_allclose(sim.applied[-1], [0, 0, 0, 1.0])  # hold with the gripper as last applied
    ctl.offer("hold", [0.005, 0, 0, 0, 0, 0, 1.0])  # a hold's values are not applied
    ctl.control_step()
    np.testing.assert_allclose(sim.applied[-1], [0, 0, 0, 1.0])
    ctl.offer("fresh", [0.004, 0, 0, 0, 0, 0, 1.0])
    ctl.control_step()
    ctl.control_step()  # the same message again: counted as reapplied
    clock.ns += 101_000_000
    ctl.control_step()  # older than action_timeout_ms
    np.testing.assert_allclose(sim.applied[-1], [0, 0, 0, -1.0])
    cur = ctl.current
    assert (cur.fresh, cur.repeat, cur.hold, cur.reapplied) == (2, 1, 1, 1)
    assert cur.sim_hold == {"no_action": 1, "stale": 1, "rejected": 1}
    assert cur.rejected["wrong_length"] == 1 and ctl.total_rejected["wrong_length"] == 1
    assert cur.received == {"fresh": 2, "repeat": 1, "hold": 1}
    assert all(np.all(np.isfinite(a)) for a in sim.applied)


def test_episodes_end_at_horizon_or_success_and_walk_the_seeds():
    sim, seen = FakeSim(horizon=3), []
    ctl = SimController(sim, seed_start=7, num_episodes=2, clock_ns=Clock(), on_result=seen.append)
    results = [r for _ in range(10) if (r := ctl.control_step()) is not None]
    assert [r.seed for r in results] == [7, 8] and sim.seeds == [7, 8]
    assert all(r.end == "horizon" and not r.success and r.steps == 3 for r in results)
    assert ctl.finished and len(sim.applied) == 6 and seen == results
    sim2 = FakeSim(horizon=50, succeed_after=4)
    ctl2 = SimController(sim2, num_episodes=1, clock_ns=Clock())
    ctl2.offer("fresh", [0.01, 0, 0, 0, 0, 0, 1.0])
    while (r := ctl2.control_step()) is None:
        pass
    assert r.success and r.end == "success" and r.steps == 4 and r.fresh == 4
    assert r.ee_start == [0.0, 0.0, 0.0] and r.ee_end[0] == pytest.approx(0.04)
    back = EpisodeResult.from_json(r.to_json())
    assert back == r and json.loads(r.to_json())["seed"] == 0


def test_wait_for_action_starts_the_first_episode_at_the_first_good_action():
    sim, clock = FakeSim(horizon=10), Clock()
    ctl = SimController(sim, clock_ns=clock, wait_for_action=True)
    assert ctl.control_step() is None and sim.applied == []
    ctl.offer("fresh", [0.0] * 3)  # a rejected one does not start it
    ctl.control_step()
    assert sim.applied == [] and not ctl.started
    clock.ns = 5_000_000_000
    ctl.offer("fresh", [0.0] * 7)
    clock.ns = 5_500_000_000
    for _ in range(10):
        r = ctl.control_step()
    assert r is not None and r.duration_s == pytest.approx(0.5) and r.steps == 10


def test_controller_rejects_bad_settings():
    with pytest.raises(ValueError):
        SimController(FakeSim(), num_episodes=-1)
    with pytest.raises(ValueError):
        SimController(FakeSim(), action_timeout_ms=0.0)


def test_commanded_jerk_is_zero_for_constant_or_linear_velocity_and_counts_a_switch():
    from vla_edge_ros.sim.episode import commanded_jerk_sq_mean

    dt = 0.1
    assert commanded_jerk_sq_mean([], dt) == 0.0 and commanded_jerk_sq_mean([[0.01, 0, 0]] * 2, dt) == 0.0
    assert commanded_jerk_sq_mean([[0.01, 0, 0]] * 10, dt) == 0.0  # constant velocity
    ramp = [[0.001 * k, 0, 0] for k in range(10)]  # constant acceleration: still no jerk
    assert commanded_jerk_sq_mean(ramp, dt) == pytest.approx(0.0, abs=1e-12)
    # one switch from +1 cm to -1 cm per step: second differences -0.02, +0.02 (m), over dt^3, at 2 of 3 points
    switch = [[0.01, 0, 0], [0.01, 0, 0], [-0.01, 0, 0], [-0.01, 0, 0]]
    assert commanded_jerk_sq_mean(switch, dt) == pytest.approx(2 * (0.02 / dt ** 3) ** 2 / 2)
    assert commanded_jerk_sq_mean(switch, 2 * dt) == pytest.approx(commanded_jerk_sq_mean(switch, dt) / 64)


def test_episode_result_carries_the_commanded_jerk_of_the_applied_steps():
    sim = FakeSim(horizon=4)
    ctl = SimController(sim, num_episodes=1, clock_ns=Clock(), control_period_s=0.1)
    for x in (0.004, 0.004, -0.004, -0.004):  # metres per step; the sim holds nothing here
        ctl.offer("fresh", [x, 0, 0, 0, 0, 0, 0.0])
        result = ctl.control_step()
    assert result is not None and result.steps == 4
    assert result.jerk_sq_mean == pytest.approx(2 * (0.008 / 0.1 ** 3) ** 2 / 2)
    smooth = SimController(FakeSim(horizon=4), num_episodes=1, clock_ns=Clock())
    for _ in range(4):
        smooth.offer("fresh", [0.004, 0, 0, 0, 0, 0, 0.0])
        r2 = smooth.control_step()
    assert r2.jerk_sq_mean == 0.0
    with pytest.raises(ValueError, match="control_period_s"):
        SimController(FakeSim(), control_period_s=0.0)


def test_new_plan_counts_steps_whose_action_comes_from_a_newer_frame():
    sim = FakeSim(horizon=100)
    ctl = SimController(sim, clock_ns=Clock())
    a = [0.001, 0, 0, 0, 0, 0, 1.0]
    steps = [("fresh", 10), ("repeat", 10), ("repeat", 20), ("repeat", 20), ("fresh", 30), ("hold", 40),
             ("repeat", 25), ("repeat", 0)]  # an older stamp (reordered) and an unknown one are not new
    for kind, stamp in steps:
        ctl.offer(kind, a, source_ns=stamp)
        ctl.control_step()
    cur = ctl.current
    assert cur.new_plan == 3  # stamps 10, 20, 30; the hold and the older / unknown stamps are not new plans
    assert (cur.fresh, cur.repeat, cur.hold) == (2, 5, 1)
