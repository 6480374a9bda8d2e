"""Bad images through a real subscription: the `vla_camera` process counts each rejection by reason, survives,
and good frames published afterwards still land in its buffer. Also the compressed transport."""
from __future__ import annotations

import contextlib
import io
import time

import numpy as np
import pytest

from ros_env import read_json, single_node_cmd, wait_for

rclpy = pytest.importorskip("rclpy")


@pytest.fixture()
def ros(ros_context, ros_processes):
    """(the test's publisher node, the RosProcesses that start vla_camera on the same domain)."""
    node = rclpy.create_node("camera_test_publisher", context=ros_context)
    yield node, ros_processes
    node.destroy_node()


def _image(h, w, enc, step, data, stamp_ns):
    from sensor_msgs.msg import Image

    from vla_edge_ros.ros.conversions import ns_to_stamp

    m = Image()
    m.header.stamp = ns_to_stamp(stamp_ns)
    m.height, m.width, m.encoding, m.step = h, w, enc, step
    m.data = bytes(data)
    return m


@contextlib.contextmanager
def camera_node(ros, msg_type, topic, pub_qos, *params, wait_log=None):
    """`vla_camera` in its own process (``-p`` params, stats JSON in the test's directory) and a publisher of
    ``msg_type`` on ``topic`` from the test's node (``ros``: the fixture); yields ``(pub, proc, stats_path)`` once
    the subscription is matched (after ``wait_log`` appears in the node's output, when given); the node must exit
    0 on SIGINT afterwards."""
    node, procs = ros
    stats = procs.tmp / "camera_stats.json"
    args = ["--stats-out", str(stats)]
    if params:
        args += ["--ros-args"] + [a for prm in params for a in ("-p", prm)]
    proc = procs.start_cmd(single_node_cmd("camera", *args), name="camera")
    pub = node.create_publisher(msg_type, topic, pub_qos)
    if wait_log is not None:
        assert wait_for(lambda: wait_log in proc.output(), 20.0), proc.output()
    assert wait_for(lambda: pub.get_subscription_count() > 0, 20.0), proc.output()
    time.sleep(0.5)
    yield pub, proc, stats
    assert procs.stop(proc) == {"camera": 0}, proc.output()


def _publish_all(pub, msgs, period_s=0.02):
    for m in msgs:
        pub.publish(m)
        time.sleep(period_s)  # best-effort, keep-last-1 subscriber: give it time to take each message


def test_bad_images_counted_by_reason_node_survives(ros):
    from sensor_msgs.msg import Image

    from vla_edge_ros.ros import qos

    with camera_node(ros, Image, "/camera/image_raw", qos.camera_publisher_qos(deadline_ms=50.0),
                     "max_image_bytes:=2000000") as (pub, proc, stats):
        now = time.time_ns()
        good = np.zeros((48, 64, 3), np.uint8)
        n = 5
        bad = {
            "empty": _image(0, 0, "rgb8", 0, b"", now),
            "unknown_encoding": _image(48, 64, "yuv422_weird", 192, good.tobytes(), now),
            "step_mismatch": _image(48, 64, "rgb8", 100, good.tobytes(), now),
            "short_data": _image(48, 64, "rgb8", 192, good.tobytes()[:-10], now),
            "too_large": _image(1000, 1000, "rgb8", 3000, b"\x00" * 16, now),
            "bad_stamp": _image(48, 64, "rgb8", 192, good.tobytes(), now + 3_600 * 10**9),
        }
        for _ in range(n):
            _publish_all(pub, bad.values())
        assert proc.alive(), proc.output()
        goods = []
        for i in range(20):
            img = np.full((48, 64, 3), i, np.uint8)
            goods.append(_image(48, 64, "rgb8", 192, img.tobytes(), time.time_ns()))
        _publish_all(pub, goods)
        time.sleep(0.3)
        assert proc.alive(), proc.output()
    s = read_json(stats)
    by_reason = s["frames"]["rejected_by_reason"]
    for reason in bad:
        # best effort: allow a lost message, but every kind of bad input must have been seen and counted
        assert 1 <= by_reason.get(reason, 0) <= n, (reason, by_reason)
    assert set(by_reason) <= set(bad), by_reason
    assert s["frames"]["rejected"] == sum(by_reason.values())
    assert 10 <= s["camera"]["accepted"] <= 20, s["camera"]
    assert s["camera"]["received"] == s["camera"]["accepted"] + s["frames"]["rejected"]
    assert "image rejected" in proc.output()


def test_compressed_transport_decodes_jpeg_and_rejects_garbage(ros):
    from PIL import Image as PILImage
    from sensor_msgs.msg import CompressedImage

    from vla_edge_ros.ros import qos
    from vla_edge_ros.ros.conversions import ns_to_stamp

    with camera_node(ros, CompressedImage, "/camera/image_raw/compressed",
                     qos.camera_publisher_qos(deadline_ms=50.0), "image_transport:=compressed") as (pub, proc, stats):
        msgs = []
        for i in range(10):
            buf = io.BytesIO()
            PILImage.fromarray(np.full((32, 48, 3), 20 * i, np.uint8)).save(buf, format="JPEG")
            m = CompressedImage(format="jpeg", data=buf.getvalue())
            m.header.stamp = ns_to_stamp(time.time_ns())
            msgs.append(m)
        garbage = CompressedImage(format="jpeg", data=b"\xff\xd8 definitely not a jpeg")
        garbage.header.stamp = ns_to_stamp(time.time_ns())
        _publish_all(pub, msgs + [garbage] * 3)
        time.sleep(0.3)
        assert proc.alive(), proc.output()
    s = read_json(stats)
    assert 5 <= s["camera"]["accepted"] <= 10, s["camera"]
    assert 1 <= s["frames"]["rejected"] <= 3, s["frames"]
    assert "(CompressedImage" in proc.output()


def test_publisher_without_deadline_gets_plain_qos_fallback(ros):
    """Most camera drivers offer no QoS deadline: DDS reports the request as incompatible; the node must
    re-subscribe with plain sensor-data QoS instead of silently receiving nothing."""
    from rclpy.qos import qos_profile_sensor_data
    from sensor_msgs.msg import Image

    with camera_node(ros, Image, "/camera/image_raw", qos_profile_sensor_data,
                     wait_log="re-subscribing with plain") as (pub, proc, stats):
        _publish_all(pub, [_image(8, 8, "mono8", 8, bytes(range(64)), time.time_ns()) for _ in range(10)])
        time.sleep(0.3)
    s = read_json(stats)
    assert s["camera"]["incompatible_qos"] >= 1
    assert s["camera"]["qos_mode"].startswith("plain")
    assert 5 <= s["camera"]["accepted"] <= 10, s["camera"]


def test_frozen_camera_detected(ros):
    from sensor_msgs.msg import Image

    from vla_edge_ros.ros import qos

    with camera_node(ros, Image, "/camera/image_raw", qos.camera_publisher_qos(deadline_ms=50.0),
                     "frozen_frame_limit:=8") as (pub, proc, stats):
        same = np.random.default_rng(3).integers(0, 256, (24, 32, 3), dtype=np.uint8).tobytes()
        _publish_all(pub, [_image(24, 32, "rgb8", 96, same, time.time_ns()) for _ in range(25)])
        time.sleep(0.3)
    s = read_json(stats)["camera"]
    assert s["frozen"] is True and s["frozen_events"] == 1, s
    assert "camera frozen" in proc.output()
