"""`python -m vla_edge_ros.ros.tools.action_monitor`: record the action stream as an independent consumer sees it.

Subscribes ``action_topic`` (JointState: kind in header.frame_id) and ``action_status_topic`` (DiagnosticStatus:
kind, source stamp, age, seq, reason) and writes one JSON object per received message (local monotonic receive
time included) to ``--out`` (JSON lines), flushing as it goes; exits on SIGINT or after ``--duration-s``.
The integration, split and soak tests analyse these files (gaps between ticks, kinds, hold reasons).
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time

import rclpy
from diagnostic_msgs.msg import DiagnosticStatus
from rclpy.executors import SingleThreadedExecutor
from rclpy.signals import SignalHandlerOptions
from rclpy.utilities import remove_ros_args
from sensor_msgs.msg import JointState

from vla_edge_ros.ros import conversions, qos


def main(args=None) -> int:
    argv = sys.argv if args is None else args
    ap = argparse.ArgumentParser(prog="vla_action_monitor")
    ap.add_argument("--out", required=True, help="JSON-lines output file")
    ap.add_argument("--action-topic", default="/vla/action")
    ap.add_argument("--status-topic", default="/vla/action_status")
    ap.add_argument("--duration-s", type=float, default=None)
    opts = ap.parse_args(remove_ros_args(argv)[1:])
    rclpy.init(args=argv, signal_handler_options=SignalHandlerOptions.NO)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    node = rclpy.create_node("vla_action_monitor")
    out = open(opts.out, "w", encoding="utf-8")
    lock = threading.Lock()

    def write(rec: dict) -> None:
        with lock:
            out.write(json.dumps(rec) + "\n")
            out.flush()

    def on_action(msg: JointState) -> None:
        write({"t": time.monotonic(), "topic": "action", "kind": msg.header.frame_id,
               "stamp_ns": conversions.stamp_to_ns(msg.header.stamp), "names": list(msg.name),
               "position": list(msg.position)})

    def on_status(msg: DiagnosticStatus) -> None:
        v = conversions.status_to_dict(msg)
        write({"t": time.monotonic(), "topic": "status", "kind": v.get("kind"), "reason": v.get("reason"),
               "seq": int(v.get("seq", 0)), "tick": int(v.get("tick", -1)), "age_ms": float(v.get("age_ms", "nan")),
               "source_stamp_ns": int(v.get("source_stamp_ns", 0)), "level": int.from_bytes(msg.level, "little")
               if isinstance(msg.level, bytes) else int(msg.level)})

    node.create_subscription(JointState, opts.action_topic, on_action, qos.reliable_qos(100))
    node.create_subscription(DiagnosticStatus, opts.status_topic, on_status, qos.reliable_qos(100))
    ex = SingleThreadedExecutor()
    ex.add_node(node)
    th = threading.Thread(target=ex.spin, daemon=True)
    th.start()
    print("action monitor ready", flush=True)
    stop.wait(opts.duration_s)
    ex.shutdown(timeout_sec=2.0)
    th.join(timeout=2.0)
    out.close()
    node.destroy_node()
    rclpy.try_shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
