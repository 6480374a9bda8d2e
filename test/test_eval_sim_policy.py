"""The sim's built-in baselines (sim/episode.py BuiltinDriver, the vla_sim ``sim_policy`` parameter): the expert's
and the hold policy's commands go through the same gate, 7 -> 4 mapping and control step as a received action.
Pure: a fake env stands in for MetaWorld."""
from __future__ import annotations

import numpy as np
import pytest

from vla_edge_ros.sim.action_map import ENV_GRIP_OPEN, ActionMapping
from vla_edge_ros.sim.episode import SIM_POLICIES, BuiltinDriver, SimController


class FakeSim:
    task, instruction, horizon = "reach", "reach the red goal", 5

    def __init__(self):
        self.mapping = ActionMapping(0.01)
        self.applied: list[np.ndarray] = []
        self.seed = None

    def reset(self, seed):
        self.seed = seed

    def step_env(self, a4):
        self.applied.append(np.asarray(a4, float))
        return False

    def ee_position(self):
        return np.zeros(3)


def _run(policy, expert=None, steps=5):
    sim = FakeSim()
    ctl = SimController(sim, seed_start=3, num_episodes=1, wait_for_action=True)
    drv = BuiltinDriver(ctl, policy, expert)
    result = None
    for _ in range(steps):
        drv.offer()
        if ctl.started:
            result = ctl.control_step() or result
    return sim, ctl, drv, result


def test_expert_drives_through_the_mapping_as_fresh_actions():
    calls = []

    def expert():  # a different action each step, like an expert reading the state
        calls.append(len(calls))
        return [0.002 * len(calls), -0.004, 0.02, 0.0, 0.0, 0.0, 0.0]

    sim, ctl, drv, result = _run("expert", expert)
    assert drv.drives and drv.offered == 5 and len(calls) == 5
    assert result is not None and (result.fresh, result.repeat, result.hold) == (5, 0, 0)
    assert sum(result.sim_hold.values()) == 0 and result.reapplied == 0  # a new command every step
    assert result.saturated == 5  # z = 2 cm per step is clipped to one env unit
    for i, a4 in enumerate(sim.applied, 1):
        np.testing.assert_allclose(a4, [0.2 * i, -0.4, 1.0, 1.0])  # metres / 0.01, gripper 0 (closed) -> +1


def test_hold_policy_holds_every_step_and_keeps_the_gripper():
    sim, ctl, drv, result = _run("hold")
    assert (result.fresh, result.repeat, result.hold) == (0, 0, 5) and result.received["hold"] == 5
    assert all(np.array_equal(a, [0, 0, 0, ENV_GRIP_OPEN]) for a in sim.applied)


def test_external_offers_nothing_and_the_sim_waits_for_received_actions():
    sim, ctl, drv, result = _run("external")
    assert not drv.drives and drv.offered == 0 and not ctl.started and sim.applied == []


def test_driver_rejects_bad_configuration_and_counts_a_bad_expert_action():
    ctl = SimController(FakeSim(), num_episodes=1)
    assert SIM_POLICIES == ("external", "expert", "hold")
    with pytest.raises(ValueError):
        BuiltinDriver(ctl, "random")
    with pytest.raises(ValueError):
        BuiltinDriver(ctl, "expert")  # no expert function
    drv = BuiltinDriver(ctl, "expert", lambda: [0.0] * 6)  # wrong length: rejected, never applied
    assert drv.offer() == "wrong_length" and ctl.current.rejected["wrong_length"] == 1
    ctl.control_step()
    assert ctl.current.sim_hold["rejected"] == 1 and ctl.current.fresh == 0


def test_sim_node_declares_sim_policy_once_with_the_driver_choices():
    pytest.importorskip("rclpy")
    from vla_edge_ros.ros.sim_node import sim_param_specs

    specs = [s for s in sim_param_specs() if s.name == "sim_policy"]
    assert len(specs) == 1  # the registry row, or the node's fallback until the registry has it -- never both
    assert specs[0].choices == SIM_POLICIES and specs[0].default == "external" and not specs[0].live
    assert specs[0].validate("expert") is None and specs[0].validate("oracle") is not None
