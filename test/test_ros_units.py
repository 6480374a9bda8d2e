"""In-process unit tests of the thin ROS layer: conversions, descriptors, the parameter callback, diagnostics
levels, runtime argument handling. No child processes."""
from __future__ import annotations

import math

import numpy as np
import pytest

rclpy = pytest.importorskip("rclpy")

from vla_edge_ros import params as P  # noqa: E402
from vla_edge_ros.core.action_arbiter import TickDecision  # noqa: E402
from vla_edge_ros.ros import conversions, diagnostics, param_bridge, runtime  # noqa: E402

NAMES = ("x", "y", "z", "roll", "pitch", "yaw", "gripper")


def test_tick_to_joint_state_and_status_carry_kind_stamp_age():
    d = TickDecision("fresh", np.arange(7, dtype=np.float64), 1_700_000_000_123_456_789, 12.5, 4, "new_action")
    js = conversions.tick_to_joint_state(d, NAMES)
    assert js.header.frame_id == "fresh" and list(js.name) == list(NAMES)
    assert conversions.stamp_to_ns(js.header.stamp) == 1_700_000_000_123_456_789
    assert list(js.position) == list(range(7))
    st = conversions.tick_to_status(d, "vla_action", tick=9)
    v = conversions.status_to_dict(st)
    assert v == {"kind": "fresh", "source_stamp_ns": "1700000000123456789", "age_ms": "12.500", "seq": "4",
                 "reason": "new_action", "tick": "9"}
    hold = TickDecision("hold", np.zeros(7), 0, math.nan, 0, "no_action_yet")
    assert conversions.tick_to_status(hold).level == diagnostics.WARN
    assert conversions.status_to_dict(conversions.tick_to_status(hold))["age_ms"] == "nan"
    with pytest.raises(ValueError):
        conversions.tick_to_joint_state(d, NAMES[:3])


def test_fresh_action_round_trip_and_rejections():
    msg = conversions.fresh_action_to_msg(np.linspace(-1, 1, 7), 5_000_000_001, NAMES, 3)
    values, stamp, names = conversions.msg_to_fresh_action(msg)
    assert stamp == 5_000_000_001 and names == list(NAMES) and np.allclose(values, np.linspace(-1, 1, 7))
    msg.position = [1.0, math.nan] + [0.0] * 5
    with pytest.raises(ValueError, match="NaN"):
        conversions.msg_to_fresh_action(msg)
    msg.position = [0.0] * 6
    with pytest.raises(ValueError, match="names"):
        conversions.msg_to_fresh_action(msg)
    msg.position = []
    with pytest.raises(ValueError):
        conversions.msg_to_fresh_action(msg)


def test_rgb_to_image_msg_round_trips_through_the_converter():
    img = np.random.default_rng(1).integers(0, 256, (6, 5, 3), dtype=np.uint8)
    m = conversions.rgb_to_image_msg(img, "rgb8", 42)
    assert (m.height, m.width, m.step) == (6, 5, 15)
    assert np.array_equal(conversions.image_msg_to_rgb(m, 1 << 20), img)
    bgr = conversions.rgb_to_image_msg(np.ascontiguousarray(img[..., ::-1]), "bgr8", 42)
    assert np.array_equal(conversions.image_msg_to_rgb(bgr, 1 << 20), img)


def test_descriptors_follow_the_registry():
    d = param_bridge.descriptor_for(P.BY_NAME["deadline_ms"])
    assert not d.read_only and d.floating_point_range[0].from_value == 1.0
    assert "next cycle" in d.description
    d = param_bridge.descriptor_for(P.BY_NAME["tokens_per_frame"])
    assert d.read_only and (d.integer_range[0].from_value, d.integer_range[0].to_value) == (1, 1024)
    d = param_bridge.descriptor_for(P.BY_NAME["eviction_policy"])
    assert all(c in d.additional_constraints for c in P.EVICTION_POLICIES)


def test_param_bridge_validates_live_changes_and_dispatches(ros_context):
    from rclpy.parameter import Parameter

    node = rclpy.create_node("vla_inference", context=ros_context)
    seen = []
    bridge = param_bridge.ParamBridge(node, P.INFERENCE, on_change=seen.append)
    r = node.set_parameters([Parameter("safety_margin_ms", value=50.0)])[0]
    assert not r.successful and "safety_margin_ms" in r.reason and seen == []
    r = node.set_parameters_atomically([Parameter("kv_budget_tokens", value=2048),
                                        Parameter("eviction_policy", value="fifo")])
    assert r.successful and seen == [{"kv_budget_tokens": 2048, "eviction_policy": "fifo"}]
    assert bridge.get("eviction_policy") == "fifo"
    r = node.set_parameters([Parameter("kv_budget_tokens", value=2000)])[0]
    assert not r.successful and "multiple" in r.reason and bridge.get("kv_budget_tokens") == 2048

    def boom(_):
        raise ValueError("engine refused")

    bridge._on_change = boom
    r = node.set_parameters([Parameter("window_frames", value=8)])[0]
    assert not r.successful and "engine refused" in r.reason and bridge.get("window_frames") == 16
    node.destroy_node()


def test_invalid_startup_parameters_refuse_to_start(ros_context):
    from rclpy.parameter import Parameter

    node = rclpy.create_node("vla_inference", context=ros_context, parameter_overrides=[
        Parameter("deadline_ms", value=5.0), Parameter("safety_margin_ms", value=8.0)])
    with pytest.raises(param_bridge.ParameterRejected, match="safety_margin_ms"):
        param_bridge.ParamBridge(node, P.INFERENCE)
    node.destroy_node()


def test_diagnostic_levels():
    cam = {"received": 10, "accepted": 8, "dropped": 1, "rejected": 2, "rejected_by_reason": {"empty": 2},
           "rate_hz": 60.0, "deadline_missed": 0, "liveliness_lost": 0, "stalled": False, "frozen": False,
           "qos_mode": "x", "callback_ms": {"p99": 0.2}}
    st = diagnostics.camera_status(cam)
    assert st.level == diagnostics.WARN and {kv.key: kv.value for kv in st.values}["rejected.empty"] == "2"
    assert diagnostics.camera_status({**cam, "rejected": 0, "rejected_by_reason": {}}).level == diagnostics.OK
    assert diagnostics.inference_status({"state": "active", "last_error": "configure failed: x"}).level == \
        diagnostics.ERROR
    assert diagnostics.inference_status({"state": "inactive"}).level == diagnostics.WARN
    assert diagnostics.inference_status({"state": "active"}).level == diagnostics.OK
    hung = diagnostics.inference_status({"state": "active", "loop": {"in_flight_ms": 5000.0}})
    assert hung.level == diagnostics.ERROR and "hung" in hung.message


def test_runtime_args(tmp_path):
    y = tmp_path / "p.yaml"
    y.write_text("vla_inference:\n  ros__parameters:\n    fresh_action_topic: /edge/fresh\n")
    argv = ["vla_runtime", "--ros-args", "--params-file", str(y)]
    assert runtime.params_file_value(argv, P.INFERENCE, "fresh_action_topic") == "/edge/fresh"
    assert runtime.params_file_value(["x"], P.INFERENCE, "fresh_action_topic") is None
    assert runtime.parse_args(["x", "--ros-args", "-p", "role:=robot"]).role == "robot"
    assert runtime.parse_args(["x", "--no-autostart"]).autostart is False
    with pytest.raises(SystemExit):
        runtime.parse_args(["x", "--role", "everything"])


def test_inference_health_error_then_recovered_then_ok():
    h = diagnostics.inference_health
    E, W, O = diagnostics.ERROR, diagnostics.WARN, diagnostics.OK
    err = "chunk_error: InjectedFault: boom"
    assert h("active") == (O, "active")
    # a chunk fault: ERROR while recent, WARN "recovered" for a while, then OK
    assert h("active", err, 0.0, False) == (E, err)
    assert h("active", err, diagnostics.ERROR_HOLD_S - 0.1, False)[0] == E
    lvl, msg = h("active", err, diagnostics.ERROR_HOLD_S + 0.1, False)
    assert lvl == W and msg.startswith("recovered") and err in msg
    assert h("active", err, diagnostics.RECOVERED_WARN_S - 0.1, False)[0] == W
    assert h("active", err, diagnostics.RECOVERED_WARN_S + 0.1, False) == (O, "active")
    # the thresholds are parameters of the pure function
    assert h("active", err, 2.0, False, error_hold_s=1.0, recovered_warn_s=3.0)[0] == W
    assert h("active", err, 3.5, False, error_hold_s=1.0, recovered_warn_s=3.0)[0] == O
    # a failed transition (sticky) or an error of unknown age never decays
    assert h("unconfigured", "configure failed: x", 1e6, True) == (E, "configure failed: x")
    assert h("active", err, None, False)[0] == E
    # after recovery an inactive node is still reported as such
    assert h("inactive", err, diagnostics.RECOVERED_WARN_S + 1, False) == (W, "inference inactive")


def test_inference_health_in_flight_chunk():
    h = diagnostics.inference_health
    E, W, O = diagnostics.ERROR, diagnostics.WARN, diagnostics.OK
    assert h("active", in_flight_ms=20.0, deadline_ms=33.0) == (O, "active")
    lvl, msg = h("active", in_flight_ms=120.0, deadline_ms=33.0)
    assert lvl == W and "120 ms" in msg and "deadline_ms=33" in msg
    assert h("active", in_flight_ms=120.0)[0] == O  # no deadline known: only the hung limit applies
    lvl, msg = h("active", in_flight_ms=diagnostics.HUNG_CHUNK_MS + 1, deadline_ms=33.0)
    assert lvl == E and "hung" in msg
    # a recent fault outranks the in-flight warning; the in-flight warning outranks "recovered"
    assert h("active", "chunk_error: x", 1.0, False, in_flight_ms=50.0, deadline_ms=33.0)[0] == E
    assert "in flight" in h("active", "chunk_error: x", diagnostics.ERROR_HOLD_S + 1, False, in_flight_ms=50.0,
                            deadline_ms=33.0)[1]


def test_inference_health_warns_when_the_estimate_exceeds_the_budget():
    h = diagnostics.inference_health
    W, O, E = diagnostics.WARN, diagnostics.OK, diagnostics.ERROR
    assert h("active", estimate_ms=11.0, budget_ms=31.0) == (O, "active")
    lvl, msg = h("active", estimate_ms=115.0, budget_ms=31.0)
    assert lvl == W and "115.0 ms > 31.0 ms" in msg and "refused" in msg
    assert h("active", estimate_ms=None, budget_ms=31.0) == (O, "active")  # no estimate yet: first chunk admitted
    assert h("inactive", estimate_ms=115.0, budget_ms=31.0) == (W, "inference inactive")  # not refusing: paused
    assert h("active", "chunk_error: x", 0.0, False, estimate_ms=115.0, budget_ms=31.0)[0] == E  # a fault first
    # through inference_status: the loop's deadline_fit figures become values and the message
    st = diagnostics.inference_status({"state": "active", "loop": {
        "deadline_fit": {"estimate_ms": 115.0, "budget_ms": 31.0, "fits": False}}})
    v = {kv.key: kv.value for kv in st.values}
    assert st.level == W and (v["chunk_estimate_ms"], v["chunk_budget_ms"]) == ("115.000", "31.000")


def test_inference_status_carries_loop_counters_and_decays():
    def values(st):
        return {kv.key: kv.value for kv in st.values}

    loop = {"in_flight_ms": 250.0, "errors": 3, "engine_resets": 2, "late_discarded": 1,
            "admission": {"deadline_ms": 33.0}}
    st = diagnostics.inference_status({"state": "active", "loop": loop})
    v = values(st)
    assert st.level == diagnostics.WARN and "250 ms" in st.message
    assert (v["chunk_in_flight_ms"], v["deadline_ms"], v["loop_errors"], v["engine_resets"],
            v["late_discarded"]) == ("250.000", "33.000", "3", "2", "1")
    snap = {"state": "active", "loop": {**loop, "in_flight_ms": 0.0}, "deadline_ms": 33.0,
            "last_error": "chunk_error: MemoryError: x", "last_error_sticky": False}
    assert diagnostics.inference_status({**snap, "last_error_age_s": 1.0}).level == diagnostics.ERROR
    rec = diagnostics.inference_status({**snap, "last_error_age_s": 7.0})
    assert rec.level == diagnostics.WARN and rec.message.startswith("recovered")
    assert values(rec)["last_error"] == "chunk_error: MemoryError: x" and values(rec)["last_error_age_s"] == "7.000"
    assert diagnostics.inference_status({**snap, "last_error_age_s": 600.0}).level == diagnostics.OK
    # the snapshot's own deadline_ms wins over the loop's admission figure
    assert diagnostics.inference_status({"state": "active", "deadline_ms": 300.0, "loop": loop}).level == \
        diagnostics.OK
