"""`vla_sim` as a real process: images arrive, received actions are applied (the hand moves as commanded), bad
actions are rejected and counted by reason, every episode's result is published and appended as a JSON line,
the seeds advance, and the node exits 0 by itself after num_episodes."""
from __future__ import annotations

import json
import math
import threading
import time

import pytest

from ros_env import SIM, read_json, wait_for

rclpy = pytest.importorskip("rclpy")
import vla_edge_ros.sim  # noqa: E402,F401  selects MUJOCO_GL before mujoco is imported

pytest.importorskip("metaworld")

NAMES = ["x", "y", "z", "roll", "pitch", "yaw", "gripper"]
GOOD = [0.01, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]  # +1 cm in x per step, gripper open
BAD = [  # (names, values, reason expected in the episode results)
    (NAMES[:6], GOOD[:6], "wrong_length"),
    (NAMES, [0.01, math.nan, 0.0, 0.0, 0.0, 0.0, 1.0], "non_finite"),
    (["y", "x"] + NAMES[2:], GOOD, "names_mismatch"),
]


def test_sim_node_applies_actions_and_records_episodes(tmp_path, ros_processes):
    from rclpy.executors import SingleThreadedExecutor
    from sensor_msgs.msg import Image, JointState
    from std_msgs.msg import String

    from vla_edge_ros.ros import qos

    ros_processes.apply_env()
    results_path, stats_path = tmp_path / "episodes.jsonl", tmp_path / "sim_stats.json"
    sim = ros_processes.start(SIM, "--stats-out", stats_path, "--ros-args",
                              "-p", "task:=reach", "-p", "horizon:=12", "-p", "num_episodes:=2", "-p", "seed_start:=3",
                              "-p", "control_hz:=20.0", "-p", "camera_hz:=10.0", "-p", "image_width:=64",
                              "-p", "image_height:=48", "-p", f"results_path:={results_path}", name="sim")
    ctx = rclpy.context.Context()
    rclpy.init(context=ctx, args=[])
    node = rclpy.create_node("sim_test_driver", context=ctx)
    images, published = [], []
    node.create_subscription(Image, "/camera/image_raw", images.append, qos.camera_subscription_qos_no_deadline())
    node.create_subscription(String, "/vla/episode_result", lambda m: published.append(json.loads(m.data)),
                             qos.reliable_qos(100))
    pub = node.create_publisher(JointState, "/vla/action", qos.reliable_qos())
    ex = SingleThreadedExecutor(context=ctx)
    ex.add_node(node)
    threading.Thread(target=ex.spin, daemon=True).start()
    try:
        assert wait_for(lambda: len(images) >= 2, 60.0), sim.output()
        assert wait_for(lambda: pub.get_subscription_count() > 0, 20.0), sim.output()
        time.sleep(0.3)  # the result publisher's reader is matched by now as well (same participant)
        i, t_end = 0, time.monotonic() + 60.0
        while sim.alive() and time.monotonic() < t_end:  # 30 Hz like vla_action; every 7th message is bad
            msg = JointState()
            names, values = (NAMES, GOOD) if i % 7 else BAD[(i // 7) % len(BAD)][:2]
            msg.header.frame_id = "fresh" if i % 2 == 0 else "repeat"
            msg.name, msg.position = list(names), [float(v) for v in values]
            pub.publish(msg)
            i += 1
            time.sleep(1 / 30)
        assert wait_for(lambda: not sim.alive(), 10.0), sim.output()
        assert sim.stop() == 0, sim.output()
        assert wait_for(lambda: len(published) == 2, 5.0), (published, sim.output())
    finally:
        ex.shutdown(timeout_sec=2.0)
        node.destroy_node()
        rclpy.shutdown(context=ctx)

    img = images[-1]
    assert (img.encoding, img.height, img.width, img.step, len(img.data)) == ("rgb8", 48, 64, 192, 48 * 64 * 3)
    assert img.header.stamp.sec > 0 and len({bytes(m.data) for m in images}) > 1  # the scene moved
    lines = [json.loads(line) for line in results_path.read_text().splitlines()]
    assert lines == published
    assert [r["seed"] for r in lines] == [3, 4] and [r["episode"] for r in lines] == [0, 1]
    for r in lines:
        assert r["task"] == "reach" and r["instruction"] == "reach the red goal"
        assert r["steps"] <= 12 and r["end"] in ("success", "horizon") and r["success"] == (r["end"] == "success")
        assert r["fresh"] + r["repeat"] > 0 and r["frames"] > 0
        # +1 cm per applied step in x: the hand moved in +x and hardly sideways (the mocap lags a little)
        moved = [b - a for a, b in zip(r["ee_start"], r["ee_end"])]
        assert moved[0] > 0.3 * 0.01 * (r["fresh"] + r["repeat"]) and abs(moved[1]) < 0.02, r
    rejected = {k: sum(r["rejected"][k] for r in lines) for k in lines[0]["rejected"]}
    assert all(rejected[reason] >= 1 for _, _, reason in BAD), rejected
    stats = read_json(stats_path)
    assert stats["episodes"]["episodes"] == 2 and stats["frames_published"] >= len(images) > 0
    # the node's totals also count what arrived after the last episode ended
    assert all(stats["episodes"]["rejected"][k] >= n for k, n in rejected.items()), (stats, rejected)


def test_camera_steps_per_frame_is_an_integer_ratio_or_refused_by_name():
    from vla_edge_ros.ros.sim_node import camera_steps_per_frame

    assert camera_steps_per_frame(10.0, 10.0) == 1 and camera_steps_per_frame(20.0, 5.0) == 4
    for control, camera in ((10.0, 20.0), (10.0, 4.0)):
        with pytest.raises(ValueError, match="camera_after_control needs control_hz / camera_hz"):
            camera_steps_per_frame(control, camera)


def test_camera_after_control_renders_every_kth_step_and_refuses_a_bad_ratio(tmp_path, ros_processes):
    stats_path = tmp_path / "sim_stats.json"
    common = ["-p", "task:=reach", "-p", "horizon:=16", "-p", "num_episodes:=1", "-p", "sim_policy:=expert",
              "-p", "image_width:=32", "-p", "image_height:=32", "-p", "camera_after_control:=true"]
    bad = ros_processes.start(SIM, "--ros-args", *common, "-p", "control_hz:=10.0", "-p", "camera_hz:=4.0",
                              name="sim_bad")
    assert wait_for(lambda: not bad.alive(), 60.0) and bad.stop() == 2, bad.output()
    assert "camera_after_control needs control_hz / camera_hz" in bad.output()
    sim = ros_processes.start(SIM, "--stats-out", stats_path, "--ros-args", *common, "-p", "control_hz:=20.0",
                              "-p", "camera_hz:=10.0", name="sim")
    assert wait_for(lambda: not sim.alive(), 90.0) and sim.stop() == 0, sim.output()
    stats = read_json(stats_path)
    assert stats["camera"] == {"mode": "after_control", "control_steps_per_frame": 2}
    steps = stats["control_period"]["ticks"]
    # one frame per 2 control ticks (the expert drives from the first tick), none from a timer of its own
    assert abs(stats["frames_published"] - steps // 2) <= 1, (stats["frames_published"], steps)
