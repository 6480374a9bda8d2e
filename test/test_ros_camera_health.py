"""The real CameraNode (in this process, callbacks called directly, a fake health clock) with the
/diagnostics camera status built from its snapshot: YUYV frames land as RGB; a rejected frame warns only
while it is within the recent window and the status returns to OK by itself (cumulative counts kept); a
bag-replay-like stream (5 Hz pictures at 60 Hz) is not frozen; a really frozen picture is, and the warning
fades after the window once the picture moves again; re-sent messages (same stamp) are counted as duplicates."""
from __future__ import annotations

import time

import numpy as np
import pytest

rclpy = pytest.importorskip("rclpy")

from vla_edge_ros.ros import conversions, diagnostics  # noqa: E402

S = 1_000_000_000


class FakeClock:
    def __init__(self):
        self.t_ns = 5000 * S

    def __call__(self):
        return self.t_ns

    def advance_s(self, s):
        self.t_ns += int(s * S)


@pytest.fixture()
def camera(ros_context):
    from rclpy.parameter import Parameter

    from vla_edge_ros.ros.camera_node import CameraNode

    clock = FakeClock()
    node = CameraNode(health_clock_ns=clock, context=ros_context,
                      parameter_overrides=[Parameter("frozen_frame_limit", value=10)])
    yield node, clock
    node.destroy_node()


def status(node):
    st = diagnostics.camera_status(node.snapshot())
    return st.level, st.message, {kv.key: kv.value for kv in st.values}


def rgb_msg(img, stamp_ns):
    return conversions.rgb_to_image_msg(img, "rgb8", stamp_ns)


def test_yuyv_frame_lands_as_rgb(camera):
    from sensor_msgs.msg import Image

    node, _ = camera
    m = Image(height=2, width=2, encoding="yuv422_yuy2", step=4)
    m.header.stamp = conversions.ns_to_stamp(time.time_ns())
    m.data = bytes([16, 128, 235, 128, 81, 90, 81, 240])  # row 0: black, white; row 1: BT.601 red twice
    node._on_image(m)
    assert node.snapshot()["accepted"] == 1, node.snapshot()
    out = node.buffer.read_latest().image
    np.testing.assert_array_equal(out[0], [[0, 0, 0], [255, 255, 255]])
    assert np.abs(out[1].astype(int) - [255, 0, 0]).max() <= 3


def test_rejection_warns_within_the_window_then_clears_by_itself(camera):
    node, clock = camera
    good = np.random.default_rng(0).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    for i in range(5):
        node._on_image(rgb_msg(np.roll(good, i), time.time_ns()))
        clock.advance_s(0.1)
    assert status(node)[0] == diagnostics.OK
    bad = rgb_msg(good, time.time_ns())
    bad.encoding = "nv12"
    node._on_image(bad)
    level, msg, values = status(node)
    assert level == diagnostics.WARN and "1 frames rejected in the last 5 s" in msg and "unknown_encoding" in msg
    assert values["frames_rejected_recent"] == "1" and values["rejected.unknown_encoding"] == "1"
    clock.advance_s(4.0)
    node._on_image(rgb_msg(good, time.time_ns()))
    assert status(node)[0] == diagnostics.WARN  # still within the window
    clock.advance_s(1.5)
    level, msg, values = status(node)
    assert level == diagnostics.OK, msg
    assert values["frames_rejected"] == "1" and values["rejected.unknown_encoding"] == "1"  # history kept
    assert values["frames_rejected_recent"] == "0" and float(values["last_rejection_age_s"]) == pytest.approx(5.5)


def test_replayed_bag_at_60hz_is_not_frozen_but_a_stopped_picture_is(camera):
    node, clock = camera
    rng = np.random.default_rng(1)
    pictures = [rng.integers(0, 256, (16, 16, 3), dtype=np.uint8) for _ in range(8)]
    for img in pictures:  # 5 Hz content, 12 ticks of 1/60 s each with fresh stamps (bag_replay --camera-hz 60)
        for _ in range(12):
            node._on_image(rgb_msg(img, time.time_ns()))
            clock.advance_s(1 / 60)
    s = node.snapshot()
    assert s["accepted"] == 96 and s["typical_hold_ms"] == pytest.approx(200.0, abs=1.0)
    first_picture_frozen = s["frozen_events"]  # only the first picture can be (no typical hold known yet)
    assert first_picture_frozen <= 1 and not s["frozen"]
    # the picture stops changing: frozen after 3 x 200 ms
    for _ in range(45):
        node._on_image(rgb_msg(pictures[-1], time.time_ns()))
        clock.advance_s(1 / 60)
    level, msg, values = status(node)
    assert node.snapshot()["frozen_events"] == first_picture_frozen + 1
    assert level == diagnostics.WARN and msg.startswith("frozen") and values["frozen"] == "True"
    # it moves again: not frozen, the warning stays for the window, then clears by itself
    node._on_image(rgb_msg(pictures[0], time.time_ns()))
    level, msg, values = status(node)
    assert values["frozen"] == "False" and level == diagnostics.WARN and "was frozen" in msg
    clock.advance_s(5.5)
    assert status(node)[0] == diagnostics.OK


def test_resent_message_is_a_duplicate_not_a_frozen_camera(camera):
    node, clock = camera
    msg = rgb_msg(np.full((8, 8, 3), 7, np.uint8), time.time_ns())
    for _ in range(30):  # the same message (same header stamp) re-sent 30 times
        node._on_image(msg)
        clock.advance_s(0.05)
    s = node.snapshot()
    assert not s["frozen"] and s["frozen_events"] == 0 and s["duplicate_frames"] == 29
    assert status(node)[2]["duplicate_frames"] == "29"
