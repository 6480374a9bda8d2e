"""`vla_test_camera`: a moving test pattern publisher (60 Hz, rgb8 640x480 by default).

Frames are a colour gradient with a bright bar sweeping across once per second and the frame counter encoded in
the first pixels, so consecutive frames always differ (the frozen-camera detector must stay quiet) and a frame
can be identified downstream. ``compressed`` publishes JPEG sensor_msgs/CompressedImage on
``<topic>/compressed`` instead (frames encoded once at start-up, so the timer only publishes).

``--stall-after-s S`` stops publishing after S seconds (the process stays alive, so DDS liveliness stays
asserted: only the subscription's QoS deadline fires), ``--stall-for-s D`` resumes after D seconds;
``--duration-s`` exits after that long. Used by the integration tests and the demo.
"""
from __future__ import annotations

import argparse
import io
import signal
import sys
import threading
import time

import numpy as np
import rclpy
from rclpy.executors import SingleThreadedExecutor
from rclpy.node import Node
from rclpy.signals import SignalHandlerOptions
from rclpy.utilities import remove_ros_args
from sensor_msgs.msg import CompressedImage, Image

from vla_edge_ros.ros import conversions, qos

ENCODINGS = ("rgb8", "bgr8", "mono8")


def pattern_cycle(width: int, height: int, n: int) -> list[np.ndarray]:
    """``n`` RGB frames of one sweep cycle (each distinct)."""
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([(xx * 255 // max(1, width - 1)), (yy * 255 // max(1, height - 1)),
                     ((xx + yy) * 255 // max(1, width + height - 2))], axis=-1).astype(np.uint8)
    frames = []
    bar = max(2, width // 16)
    for i in range(n):
        f = base.copy()
        x0 = (i * width) // n
        f[:, x0:x0 + bar] = 255
        frames.append(f)
    return frames


def to_encoding(rgb: np.ndarray, encoding: str) -> np.ndarray:
    if encoding == "rgb8":
        return rgb
    if encoding == "bgr8":
        return np.ascontiguousarray(rgb[..., ::-1])
    if encoding == "mono8":
        return np.ascontiguousarray(rgb.mean(axis=2).astype(np.uint8))
    raise ValueError(f"unsupported test camera encoding {encoding!r} (one of {', '.join(ENCODINGS)})")


class TestCamera(Node):
    def __init__(self, stall_after_s: float | None = None, stall_for_s: float | None = None, **kw):
        super().__init__("vla_test_camera", **kw)
        self.declare_parameter("topic", "/camera/image_raw")
        self.declare_parameter("rate_hz", 60.0)
        self.declare_parameter("width", 640)
        self.declare_parameter("height", 480)
        self.declare_parameter("encoding", "rgb8")
        self.declare_parameter("compressed", False)
        self.declare_parameter("jpeg_quality", 85)
        self.declare_parameter("frame_id", "test_camera")
        g = lambda n: self.get_parameter(n).value  # noqa: E731
        self.rate_hz, self.encoding = float(g("rate_hz")), str(g("encoding"))
        self.compressed, self.frame_id = bool(g("compressed")), str(g("frame_id"))
        w, h = int(g("width")), int(g("height"))
        if self.encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {ENCODINGS}, got {self.encoding!r}")
        if not (w > 0 and h > 0 and self.rate_hz > 0):
            raise ValueError("width, height and rate_hz must be positive")
        n = max(2, int(round(self.rate_hz)))
        frames = pattern_cycle(w, h, n)
        if self.compressed:
            from PIL import Image as PILImage

            self._jpegs = []
            for f in frames:
                buf = io.BytesIO()
                PILImage.fromarray(f).save(buf, format="JPEG", quality=int(g("jpeg_quality")))
                self._jpegs.append(buf.getvalue())
            topic = str(g("topic")).rstrip("/") + "/compressed"
            self._pub = self.create_publisher(CompressedImage, topic, qos.camera_publisher_qos())
        else:
            self._frames = [to_encoding(f, self.encoding) for f in frames]
            topic = str(g("topic"))
            self._pub = self.create_publisher(Image, topic, qos.camera_publisher_qos())
        self.n = n
        self.published = 0
        self.stall_after_s, self.stall_for_s = stall_after_s, stall_for_s
        self._t0 = time.monotonic()
        self._msg = Image()
        self._timer = self.create_timer(1.0 / self.rate_hz, self._on_timer)
        self.get_logger().info(f"publishing {'JPEG' if self.compressed else self.encoding} {w}x{h} at "
                               f"{self.rate_hz} Hz on {topic}")

    def stalled(self, now: float) -> bool:
        if self.stall_after_s is None:
            return False
        t = now - self._t0
        if t < self.stall_after_s:
            return False
        return self.stall_for_s is None or t < self.stall_after_s + self.stall_for_s

    def _on_timer(self) -> None:
        if self.stalled(time.monotonic()):
            return
        i = self.published % self.n
        stamp_ns = self.get_clock().now().nanoseconds
        if self.compressed:
            msg = CompressedImage()
            msg.header.stamp = conversions.ns_to_stamp(stamp_ns)
            msg.header.frame_id = self.frame_id
            msg.format = "jpeg"
            msg.data = self._jpegs[i]
        else:
            img = self._frames[i]
            if self.published >= self.n:  # keep frames distinct forever: a cycle counter in the first pixels
                img = img.copy()
                img.reshape(-1)[:8] = np.frombuffer(np.int64(self.published).tobytes(), np.uint8)
            msg = conversions.rgb_to_image_msg(img, self.encoding, stamp_ns, self.frame_id)
        self._pub.publish(msg)
        self.published += 1


def main(args=None) -> int:
    argv = sys.argv if args is None else args
    ap = argparse.ArgumentParser(prog="vla_test_camera", description=__doc__.split("\n")[0])
    ap.add_argument("--stall-after-s", type=float, default=None, help="stop publishing after this many seconds")
    ap.add_argument("--stall-for-s", type=float, default=None, help="resume after stalling this long")
    ap.add_argument("--duration-s", type=float, default=None, help="exit after this many seconds")
    opts = ap.parse_args(remove_ros_args(argv)[1:])
    rclpy.init(args=argv, signal_handler_options=SignalHandlerOptions.NO)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    node = TestCamera(opts.stall_after_s, opts.stall_for_s)
    ex = SingleThreadedExecutor()
    ex.add_node(node)
    th = threading.Thread(target=ex.spin, name="test_camera", daemon=True)
    th.start()
    stop.wait(opts.duration_s)
    ex.shutdown(timeout_sec=2.0)
    th.join(timeout=2.0)
    node.get_logger().info(f"published {node.published} frames")
    node.destroy_node()
    rclpy.try_shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
