"""Live parameter changes from a second process through the ROS 2 parameter services (what `ros2 param set`
uses): accepted changes take effect at their documented point, invalid ones are rejected with a reason."""
from __future__ import annotations

import time

import pytest

from ros_env import read_json, read_json_when, runtime_with_param_clients, wait_for

rclpy = pytest.importorskip("rclpy")


@pytest.fixture(scope="module")
def system(module_ros_processes):
    ticks: list[float] = []

    def subscribe(node):
        from sensor_msgs.msg import JointState

        from vla_edge_ros.ros import qos

        node.create_subscription(JointState, "/vla/action", lambda m: ticks.append(time.monotonic()),
                                 qos.reliable_qos(100))

    with runtime_with_param_clients(module_ros_processes, "param_test_client",
                                    ("vla_inference", "vla_action", "vla_camera"), 0.3, subscribe) as sys_:
        stats = sys_["stats"]
        assert wait_for(lambda: stats.exists() and read_json(stats)["chunks"]["admitted"] > 5, 30.0), \
            sys_["runtime"].output()
        yield {**sys_, "ticks": ticks}


def _set(system, node: str, name: str, value):
    from rclpy.parameter import Parameter

    fut = system["clients"][node].set_parameters([Parameter(name, value=value)])
    t_end = time.monotonic() + 10.0
    while not fut.done() and time.monotonic() < t_end:
        time.sleep(0.02)
    assert fut.done(), f"no answer setting {node}.{name}"
    return fut.result().results[0]


def _get(system, node: str, name: str):
    fut = system["clients"][node].get_parameters([name])
    assert wait_for(fut.done, 10.0)
    from rclpy.parameter import parameter_value_to_python

    return parameter_value_to_python(fut.result().values[0])


def _stats_when(system, pred, timeout_s=10.0) -> dict:
    return read_json_when(system["stats"], pred, timeout_s)


@pytest.mark.parametrize("node,name,value,why", [
    ("vla_inference", "safety_margin_ms", 40.0, "safety_margin_ms"),  # >= deadline_ms: no time left
    ("vla_inference", "eviction_policy", "lru", "not one of"),
    ("vla_inference", "kv_budget_tokens", 1000, "multiple of tokens_per_frame"),
    ("vla_inference", "deadline_ms", -5.0, "deadline_ms"),  # out of the descriptor's range
    ("vla_inference", "deadline_ms", "fast", "wrong parameter type"),  # rclpy: type is fixed
    ("vla_inference", "tokens_per_frame", 64, "read-only"),
    ("vla_action", "action_rate_hz", 0.0, "action_rate_hz"),
    ("vla_camera", "camera_topic", "/other", "read-only"),
])
def test_invalid_changes_rejected_with_reason(system, node, name, value, why):
    before = _get(system, node, name)
    res = _set(system, node, name, value)
    assert not res.successful
    assert why.lower() in res.reason.lower() or name in res.reason, res.reason
    assert _get(system, node, name) == before
    assert system["runtime"].alive()


def test_admission_changes_apply_next_cycle(system):
    assert _set(system, "vla_inference", "deadline_ms", 30.0).successful
    assert _set(system, "vla_inference", "safety_margin_ms", 3.0).successful
    assert _set(system, "vla_inference", "ema_alpha", 0.5).successful
    s = _stats_when(system, lambda s: s["inference"]["admission"]["deadline_ms"] == 30.0
                    and s["inference"]["admission"]["safety_margin_ms"] == 3.0
                    and s["inference"]["admission"]["ema_alpha"] == 0.5)
    assert _get(system, "vla_inference", "deadline_ms") == 30.0
    # the cross check uses the new values: a margin above the NEW deadline is refused
    assert not _set(system, "vla_inference", "safety_margin_ms", 31.0).successful
    assert s["inference"]["state"] == "active"


def test_kv_changes_applied_by_the_inference_thread(system):
    assert _set(system, "vla_inference", "eviction_policy", "fifo").successful
    assert _set(system, "vla_inference", "kv_budget_tokens", 256).successful  # shrink: evicts at once
    s = _stats_when(system, lambda s: s["inference"]["kv_manager"].get("policy") == "fifo"
                    and s["inference"]["kv_manager"].get("budget_tokens") == 256)
    assert s["inference"]["kv_manager"]["occupancy_tokens"] <= 256
    adm = s["chunks"]["admitted"]
    _stats_when(system, lambda s: s["chunks"]["admitted"] > adm + 5)  # inference carries on after the shrink


def test_action_rate_and_staleness_live(system):
    assert _set(system, "vla_action", "stale_after_ms", 500.0).successful
    _stats_when(system, lambda s: s["action"]["arbiter"]["stale_after_ms"] == 500.0)
    ticks = system["ticks"]

    def rate_over(seconds: float) -> float:
        n0 = len(ticks)
        time.sleep(seconds)
        return (len(ticks) - n0) / seconds

    before = rate_over(2.0)
    assert _set(system, "vla_action", "action_rate_hz", 10.0).successful
    time.sleep(0.5)
    after = rate_over(3.0)
    assert 20.0 <= before <= 40.0, before
    assert 6.0 <= after <= 14.0, after
    s = _stats_when(system, lambda s: s["action"]["action_rate_hz"] == 10.0)
    assert s["inference"]["loop"]["period_ms"] == pytest.approx(100.0)  # inference cycle follows the rate
    assert _set(system, "vla_action", "action_rate_hz", 30.0).successful
