"""A frozen camera (the same frame content repeating) in front of a real `vla_runtime` (issue 6): detected,
reported on /diagnostics (camera status WARN "frozen"), the action publisher holds while ``hold_on_frozen`` is
true (stale reason ``camera_frozen``), fresh actions resume when the picture moves again; with
``hold_on_frozen`` false (changed live) a frozen camera is reported but not held on.

The camera is this test process: moving frames, then one frame repeated, then moving frames again."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from ros_env import call_answered, read_json, read_json_when, wait_for

FROZEN_LIMIT = 10
rclpy = pytest.importorskip("rclpy")


class FakeCameraAndDiag:
    """Publishes rgb8 frames at 30 Hz (moving or frozen) and records the camera's /diagnostics status, on the
    domain of ``procs`` (a RosProcesses)."""

    def __init__(self, procs):
        from diagnostic_msgs.msg import DiagnosticArray
        from rclpy.executors import SingleThreadedExecutor
        from rclpy.parameter_client import AsyncParameterClient
        from sensor_msgs.msg import Image

        from vla_edge_ros.ros import qos

        procs.apply_env()
        self.ctx = rclpy.context.Context()
        rclpy.init(context=self.ctx, args=[])
        self.node = rclpy.create_node("frozen_test_camera", context=self.ctx)
        self.pub = self.node.create_publisher(Image, "/camera/image_raw", qos.camera_publisher_qos(100.0))
        self.camera_diag: list[tuple[int, str, dict]] = []
        self.lock = threading.Lock()

        def on_diag(arr):
            for st in arr.status:
                if st.name == "vla_camera: ingest":
                    lvl = int.from_bytes(st.level, "little") if isinstance(st.level, bytes) else int(st.level)
                    with self.lock:
                        self.camera_diag.append((lvl, st.message, {kv.key: kv.value for kv in st.values}))

        self.node.create_subscription(DiagnosticArray, "/diagnostics", on_diag, qos.reliable_qos(20))
        self.params = AsyncParameterClient(self.node, "vla_camera")
        self.ex = SingleThreadedExecutor(context=self.ctx)
        self.ex.add_node(self.node)
        self.th = threading.Thread(target=self.ex.spin, daemon=True)
        self.th.start()
        self.frozen = threading.Event()
        self._stop = threading.Event()
        rng = np.random.default_rng(5)
        self.frames = [rng.integers(0, 256, (48, 64, 3), dtype=np.uint8) for _ in range(30)]
        self.cam = threading.Thread(target=self._publish_loop, daemon=True)
        self.cam.start()

    def _publish_loop(self):
        from vla_edge_ros.ros.conversions import rgb_to_image_msg

        i = 0
        while not self._stop.is_set():
            if not self.frozen.is_set():
                i += 1
            self.pub.publish(rgb_to_image_msg(self.frames[i % len(self.frames)], "rgb8", time.time_ns()))
            self._stop.wait(1 / 30)

    def last_diag(self):
        with self.lock:
            return self.camera_diag[-1] if self.camera_diag else None

    def set_hold_on_frozen(self, value: bool):
        from rclpy.parameter import Parameter

        assert self.params.wait_for_services(timeout_sec=20.0)
        # setting the same value again is harmless, so the first request may be resent (see call_answered)
        res = call_answered(lambda: self.params.set_parameters([Parameter("hold_on_frozen", value=value)]),
                            what="vla_camera/set_parameters").results[0]
        assert res.successful, res.reason

    def close(self):
        self._stop.set()
        self.cam.join(timeout=2.0)
        self.ex.shutdown(timeout_sec=2.0)
        self.node.destroy_node()
        rclpy.shutdown(context=self.ctx)


def test_frozen_camera_reported_and_held_on(tmp_path, ros_processes):
    stats_path = tmp_path / "runtime.json"
    runtime = ros_processes.runtime("-p", "kv_budget_tokens:=512", "-p", f"frozen_frame_limit:={FROZEN_LIMIT}",
                                    "-p", "hold_on_frozen:=true", stats_out=stats_path, stats_every_s=0.2)
    cam = FakeCameraAndDiag(ros_processes)

    def stats():
        for _ in range(20):
            try:
                return read_json(stats_path)
            except (OSError, ValueError):
                time.sleep(0.02)
        return read_json(stats_path)

    def when(pred, timeout_s=10.0):
        return read_json_when(stats_path, pred, timeout_s,
                              show=lambda s: ((s or {}).get("camera"), (s or {}).get("ticks")))

    def tick_deltas(seconds):
        a = stats()["ticks"]
        time.sleep(seconds)
        b = stats()["ticks"]
        return {k: b[k] - a[k] for k in ("fresh", "repeat", "hold")}

    try:
        ros_processes.wait_active(runtime)
        # moving picture: fresh actions, camera not frozen
        when(lambda s: s["ticks"]["fresh"] > 10 and s["camera"]["accepted"] > 20)
        assert stats()["camera"]["frozen"] is False
        assert wait_for(lambda: cam.last_diag() is not None and cam.last_diag()[2]["frozen"] == "False", 5.0)

        # the picture freezes: detected after FROZEN_LIMIT identical frames, the publisher holds
        cam.frozen.set()
        s = when(lambda s: s["camera"]["frozen"] and "camera_frozen" in s["action"]["arbiter"]["stale_reasons"])
        assert s["camera"]["frozen_events"] == 1
        time.sleep(0.3)
        d = tick_deltas(1.0)
        assert d["fresh"] == 0 and d["hold"] >= 20, d
        assert wait_for(lambda: cam.last_diag()[2]["frozen"] == "True", 5.0)
        lvl, msg, _ = cam.last_diag()
        assert lvl == 1 and "frozen" in msg  # WARN
        assert "camera frozen" in runtime.output()

        # hold_on_frozen switched off live: still reported frozen, but fresh actions flow again
        cam.set_hold_on_frozen(False)
        when(lambda s: "camera_frozen" not in s["action"]["arbiter"]["stale_reasons"])
        time.sleep(0.3)
        d = tick_deltas(1.0)
        assert d["fresh"] >= 10 and stats()["camera"]["frozen"] is True, d
        cam.set_hold_on_frozen(True)
        when(lambda s: "camera_frozen" in s["action"]["arbiter"]["stale_reasons"])

        # the picture moves again: not frozen, the hold ends by itself, fresh actions resume
        cam.frozen.clear()
        when(lambda s: not s["camera"]["frozen"] and not s["action"]["arbiter"]["stale_reasons"])
        time.sleep(0.3)
        d = tick_deltas(1.0)
        assert d["fresh"] >= 10 and d["hold"] <= 3, d
        assert wait_for(lambda: cam.last_diag()[2]["frozen"] == "False", 5.0)
    finally:
        cam.close()
    assert ros_processes.stop(runtime) == {"runtime": 0}, runtime.output()[-3000:]
