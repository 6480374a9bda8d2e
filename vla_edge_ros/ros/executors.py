"""The process's threading rule for ROS nodes: one ``SingleThreadedExecutor`` per node, each in its own thread.

Why: on the 2-core machine a ``MultiThreadedExecutor`` stalled the action publisher's 30 Hz timer, while one
single-threaded executor per node kept the timer's period error p99 <= 1.4 ms (ros/runtime.py). The runtime and
the fleet's camera process (ros/fleet_cameras.py) both follow it; this is the one copy of how.
"""
from __future__ import annotations

import sys
import threading
from typing import Any, Iterable

import rclpy
from rclpy.executors import SingleThreadedExecutor


def spin_each(nodes: Iterable[Any], context: Any) -> tuple[list[SingleThreadedExecutor], list[threading.Thread]]:
    """Start one executor thread (``exec:<node name>``, daemon) per node; returns the executors and threads."""
    executors, threads = [], []
    for node in nodes:
        ex = SingleThreadedExecutor(context=context)
        ex.add_node(node)
        name = node.get_name()
        ns = node.get_namespace().strip("/")
        label = f"{ns}/{name}" if ns else name
        th = threading.Thread(target=_spin, args=(ex, label, context), name=f"exec:{label}", daemon=True)
        executors.append(ex)
        threads.append(th)
        th.start()
    return executors, threads


def stop_spinning(executors: Iterable[SingleThreadedExecutor], threads: Iterable[threading.Thread],
                  shutdown_timeout_s: float = 2.0, join_timeout_s: float = 3.0) -> None:
    """Shut the executors down, then join their threads: out of rclpy's native code before the context goes
    (else the process's exit may abort)."""
    for ex in executors:
        ex.shutdown(timeout_sec=shutdown_timeout_s)
    for th in threads:
        th.join(timeout=join_timeout_s)


def _spin(ex: SingleThreadedExecutor, label: str, context: Any) -> None:
    try:
        ex.spin()
    except Exception as exc:  # the context shut down under it: leave quietly; anything else is said
        if rclpy.ok(context=context):
            print(f"[vla_edge_ros] executor of {label} stopped: {exc!r}", file=sys.stderr)
