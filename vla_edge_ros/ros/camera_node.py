"""`vla_camera`: camera subscriber -> freshest-frame double buffer.

Hot path (one callback per image, on this node's own executor thread): validate + convert with numpy
(core.image_convert), stamp checks, frozen-frame check, one DoubleBuffer.write. It never blocks on inference
and never raises: every bad image is rejected, counted per reason (``/diagnostics``) and logged (throttled).

Stale-input detection comes from the middleware's own events on the subscription:
- QoS deadline missed (no frame for ``camera_deadline_ms``): counted, camera flagged 'stalled';
- liveliness lost (the publisher process died / stopped asserting): the action arbiter is told at once
  (``mark_inputs_stale('camera_liveliness_lost')``) so the robot holds without waiting for the frame age;
- both clear on the next good frame. The arbiter's own frame-age check (``stale_after_ms``) is the backstop.
Rejections and frozen frames are also kept over a recent window (core.camera_health, ``HEALTH_WINDOW_S``) so
/diagnostics reports what is wrong *now* and returns to OK by itself; the all-time counts stay in the values.
The frozen rule judges content against time and header stamps (see camera_health.FrozenDetector), so a bag
replay that re-times a 5 Hz dataset to 60 Hz is not "frozen".
If a camera offers no deadline/liveliness (most drivers), DDS reports the QoS as incompatible; the node then
re-subscribes with plain sensor-data QoS and relies on the frame-age check alone (logged and in diagnostics).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import numpy as np
from rclpy.event_handler import SubscriptionEventCallbacks
from rclpy.node import Node
from rclpy.parameter import Parameter
from sensor_msgs.msg import CompressedImage, Image

from vla_edge_ros import params as registry
from vla_edge_ros.core import camera_health, image_convert
from vla_edge_ros.core.double_buffer import DoubleBuffer
from vla_edge_ros.core.metrics import LatencyStats, RateCounter
from vla_edge_ros.ros import conversions, qos
from vla_edge_ros.ros.param_bridge import ParamBridge


def camera_parameter_overrides(values: Mapping[str, Any]) -> list:
    """The ``vla_camera`` parameters among ``values`` as a node's ``parameter_overrides`` (other names dropped): what
    the fleet's camera nodes are built with, in the edge's process or in the cameras' own."""
    return [Parameter(k, value=v) for k, v in values.items()
            if k in registry.BY_NAME and registry.BY_NAME[k].node == registry.CAMERA]


@dataclass
class CameraFrame:
    """What the camera writes into the double buffer (the inference loop's input)."""
    image: np.ndarray  # (H, W, 3) uint8 RGB
    stamp_ns: int  # header.stamp of the camera message (ROS time)
    received_ns: int  # ROS clock when the callback ran
    frame_id: int  # running count of accepted frames (engine frame id / KV slot owner)
    header_frame_id: str = ""


@dataclass
class CameraStats:
    received: int = 0  # messages that reached the callback
    accepted: int = 0  # written into the double buffer
    deadline_missed: int = 0
    liveliness_lost: int = 0
    incompatible_qos: int = 0


class CameraNode(Node):
    NODE_NAME = registry.CAMERA
    HEALTH_WINDOW_S = camera_health.DEFAULT_WINDOW_S  # rejections / frozen frames older than this stop warning

    def __init__(self, frame_buffer: DoubleBuffer | None = None, arbiter: Any = None,
                 on_stale: Callable[[str, bool], None] | None = None,
                 health_clock_ns: Callable[[], int] = time.monotonic_ns, **node_kwargs):
        super().__init__(self.NODE_NAME, **node_kwargs)
        self.params = ParamBridge(self, registry.CAMERA, on_change=self._on_params)
        self.buffer: DoubleBuffer = frame_buffer if frame_buffer is not None else DoubleBuffer()
        # Where staleness is reported: the ActionArbiter in role all (``arbiter``), or any callback.
        self._arbiter = arbiter
        self._on_stale = on_stale
        self.stats = CameraStats()
        # Durations on the monotonic clock (injectable for tests): ROS time may be sim time or a bag's.
        self._health_clock_ns = health_clock_ns
        self._rejections = camera_health.RejectionCounter(self.HEALTH_WINDOW_S, health_clock_ns)
        self._frozen = camera_health.FrozenDetector(self.params.get("frozen_frame_limit"), clock_ns=health_clock_ns)
        self._frozen_recent = camera_health.EventWindow(self.HEALTH_WINDOW_S, health_clock_ns)  # frames while frozen
        self.callback_ms = LatencyStats(4096)  # cost of the image callback itself (runtime_bench reads it)
        self.rate = RateCounter(1.0)
        self.stalled = False  # deadline missed since the last good frame
        self.publisher_alive: Optional[bool] = None
        self.frozen = False
        self.qos_mode = "deadline+liveliness"
        self._stale_reasons: set[str] = set()
        self._next_frame_id = 0
        self._last_log_ns = 0
        self._sub = None
        self._subscribe(with_deadline=True)

    # ---- subscription -------------------------------------------------------------------------------
    def _topic_and_type(self):
        topic = self.params.get("camera_topic")
        if self.params.get("image_transport") == "compressed":
            return topic.rstrip("/") + "/compressed", CompressedImage
        return topic, Image

    def _subscribe(self, with_deadline: bool) -> None:
        topic, msg_type = self._topic_and_type()
        if with_deadline:
            profile = qos.camera_subscription_qos(self.params.get("camera_deadline_ms"))
            events = SubscriptionEventCallbacks(
                deadline=self._on_deadline_missed,
                liveliness=self._on_liveliness_changed,
                incompatible_qos=self._on_incompatible_qos,
            )
        else:
            profile = qos.camera_subscription_qos_no_deadline()
            events = SubscriptionEventCallbacks(incompatible_qos=self._on_incompatible_qos)
        cb = self._on_compressed if msg_type is CompressedImage else self._on_image
        self._sub = self.create_subscription(msg_type, topic, cb, profile, event_callbacks=events)
        self.get_logger().info(f"subscribed {topic} ({msg_type.__name__}, {self.qos_mode} QoS)")

    def _on_incompatible_qos(self, info) -> None:
        self.stats.incompatible_qos += 1
        if self.qos_mode != "deadline+liveliness":
            self.get_logger().error(f"camera publisher QoS incompatible even with plain sensor-data QoS: "
                                    f"policy {info.last_policy_kind}")
            return
        self.get_logger().warning(
            f"camera publisher does not offer the requested deadline/liveliness (policy {info.last_policy_kind}); "
            "re-subscribing with plain sensor-data QoS: stalls are then detected by frame age only")
        self.qos_mode = "plain (publisher offers no deadline)"
        # Not from inside this subscription's own event callback: swap on a one-shot timer.
        timer = None

        def swap():
            timer.cancel()
            self.destroy_timer(timer)
            old, self._sub = self._sub, None
            if old is not None:
                self.destroy_subscription(old)
            self._subscribe(with_deadline=False)

        timer = self.create_timer(0.001, swap)

    def _on_deadline_missed(self, info) -> None:
        self.stats.deadline_missed += max(1, int(getattr(info, "total_count_change", 1)))
        if not self.stalled:
            self.stalled = True
            self.get_logger().warning(f"camera stalled: no frame within camera_deadline_ms="
                                      f"{self.params.get('camera_deadline_ms')}")

    def _on_liveliness_changed(self, info) -> None:
        alive = int(info.alive_count) > 0
        if self.publisher_alive is not False and not alive and info.not_alive_count_change > 0:
            self.stats.liveliness_lost += 1
            self.get_logger().warning("camera publisher lost liveliness: holding")
            self._set_stale("camera_liveliness_lost", True)
        self.publisher_alive = alive

    def _set_stale(self, reason: str, stale: bool) -> None:
        if stale == (reason in self._stale_reasons):
            return
        (self._stale_reasons.add if stale else self._stale_reasons.discard)(reason)
        if self._arbiter is not None:
            (self._arbiter.mark_inputs_stale if stale else self._arbiter.clear_stale)(reason)
        if self._on_stale is not None:
            self._on_stale(reason, stale)

    # ---- hot path -----------------------------------------------------------------------------------
    def _on_image(self, msg: Image) -> None:
        self._ingest(msg, conversions.image_msg_to_rgb)

    def _on_compressed(self, msg: CompressedImage) -> None:
        self._ingest(msg, conversions.compressed_msg_to_rgb)

    def _ingest(self, msg, convert) -> None:
        t0 = time.perf_counter_ns()
        self.stats.received += 1
        try:
            now_ns = self.get_clock().now().nanoseconds
            try:
                stamp_ns = image_convert.check_stamp(msg.header.stamp.sec, msg.header.stamp.nanosec, now_ns)
                img = self._convert(msg, convert)
            except image_convert.ImageRejected as exc:
                self._reject(exc.reason, str(exc))
                return
            frozen = self._frozen.update(img, stamp_ns)  # judged on the receive time (health clock)
            if frozen:
                self._frozen_recent.add("frozen")
                if not self.frozen:
                    f = self._frozen.snapshot()
                    self.get_logger().warning(
                        f"camera frozen: identical frames repeating ({f['run_length']} frames, "
                        f"{f['unchanged_s']:.2f} s unchanged; this source's pictures usually last "
                        f"{f['typical_hold_ms'] if f['typical_hold_ms'] is not None else '?'} ms)")
            self.frozen = frozen
            self._set_stale("camera_frozen", frozen and self.params.get("hold_on_frozen"))
            self._next_frame_id += 1
            self.buffer.write(self._make_frame(img, msg, convert, stamp_ns, now_ns))
            self.stats.accepted += 1
            self.rate.add()
            if self._arbiter is not None:
                self._arbiter.note_frame(stamp_ns, now_ns)
            self.stalled = False
            if self._stale_reasons - {"camera_frozen"}:
                self._set_stale("camera_liveliness_lost", False)
        except Exception as exc:  # never let one message kill the camera node
            self._reject("internal_error", repr(exc))
        finally:
            self.callback_ms.add((time.perf_counter_ns() - t0) / 1e6)

    def _convert(self, msg, convert) -> np.ndarray:
        """What the frozen check keys on and the frame carries: the RGB image (ImageRejected when malformed).
        A hook: the fleet edge's cameras (ros/fleet_node.py) leave costly conversions to the frame's taker."""
        return convert(msg, self.params.get("max_image_bytes"))

    def _make_frame(self, img: np.ndarray, msg, convert, stamp_ns: int, now_ns: int) -> Any:
        return CameraFrame(img, stamp_ns, now_ns, self._next_frame_id, msg.header.frame_id)

    def _reject(self, reason: str, detail: str) -> None:
        self._rejections.add(reason, detail)
        now = time.monotonic_ns()
        if now - self._last_log_ns > 1_000_000_000:  # throttle: a broken camera at 60 Hz must not flood the log
            self._last_log_ns = now
            snap = self._rejections.snapshot()
            self.get_logger().warning(f"image rejected ({reason}): {detail} [{snap['recent']} in the last "
                                      f"{snap['window_s']:g} s; so far: {snap['by_reason']}]")

    # ---- live parameters ----------------------------------------------------------------------------
    def _on_params(self, changes: dict) -> None:
        if "frozen_frame_limit" in changes:
            self._frozen.set_limit(changes["frozen_frame_limit"])
            self.frozen = False
            self._set_stale("camera_frozen", False)
        if "hold_on_frozen" in changes and not changes["hold_on_frozen"]:
            self._set_stale("camera_frozen", False)

    # ---- figures ------------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        buf = self.buffer.stats()
        rej = self._rejections.snapshot()
        frozen = self._frozen.snapshot()
        return {
            "received": self.stats.received,
            "accepted": self.stats.accepted,
            "rejected": rej["total"],
            "rejected_by_reason": rej["by_reason"],
            "last_rejection": rej["last_message"],
            "last_rejection_age_s": rej["last_age_s"],
            "window_s": rej["window_s"],
            "rejected_recent": rej["recent"],
            "rejected_recent_by_reason": rej["recent_by_reason"],
            "rejection_rate_hz": rej["recent_rate_hz"],
            "dropped": buf["overwritten"],
            "buffer": buf,
            "rate_hz": self.rate.rate(),
            "deadline_missed": self.stats.deadline_missed,
            "liveliness_lost": self.stats.liveliness_lost,
            "incompatible_qos": self.stats.incompatible_qos,
            "stalled": self.stalled,
            "frozen": self.frozen,
            "frozen_events": frozen["frozen_events"],
            "frozen_frames_recent": self._frozen_recent.count(),
            "frozen_unchanged_s": frozen["unchanged_s"],
            "frozen_hold_limit_ms": frozen["hold_limit_ms"],
            "typical_hold_ms": frozen["typical_hold_ms"],
            "duplicate_frames": frozen["duplicates"],
            "qos_mode": self.qos_mode,
            "callback_ms": self.callback_ms.summary(),
        }
