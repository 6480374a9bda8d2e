"""The fleet edge's camera subscriptions in a process of their own (``fleet_camera_process``, on by default).

Why: in one process, N cameras at 60 Hz and the fleet loop share one interpreter. Issue 24's 8-robot replay on
the H200 (docs/FIGURES.md) measured the loop's slow passes waiting tens of milliseconds for the GIL while the
machine's cores sat idle, and py-spy's GIL sampling named the camera executors (rclpy taking messages and building
wait sets) as its main holder. Here the cameras run in a child process with its own interpreter and hand frames to
the loop through shared memory (core/shared_frames.SharedFrameBuffer): the loop's process keeps the engine, the
fresh-action publishers, lifecycle, parameters and /diagnostics.

What stays the same for users: the camera nodes are the same ``/<ns>/vla_camera`` nodes (camera_node.CameraNode:
its validation, stall / liveliness / frozen detection, parameter services), each subscribed to
``/<ns><camera_topic>``; their figures reach the edge's /diagnostics ``vla_camera: ingest [<ns>]`` entries through
a pipe (``CameraProxy.snapshot``). What differs: frames are converted to RGB in the camera process on receipt
(a JPEG decode costs that process's CPU, not the loop's GIL), and a frame larger than ``fleet_frame_bytes`` is
rejected there by name (``too_large_for_buffer``).

Supervision (``FleetCameraProcess.poll``, from a timer of the fleet node): the child reports every
``status_period_s``; a child that exits is reported (ERROR in every robot's camera status until it is back),
restarted with fresh locks (the dead one may hold one) and counted; restarts back off once they come faster than
one per ``RESTART_BACKOFF_S``. The child exits when the parent asks, or when the pipe to its parent closes (the
parent died): it never outlives the edge.

The child builds its own rclpy context; nothing of the parent's is shared but the buffers and the pipe.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from typing import Any, Callable, Mapping, Optional, Sequence

from vla_edge_ros.core import image_convert
from vla_edge_ros.core.metrics import LatencyStats
from vla_edge_ros.core.shared_frames import SharedFrameBuffer
from vla_edge_ros.ros.camera_node import CameraNode, camera_parameter_overrides

RESTART_BACKOFF_S = 5.0  # at most one restart per this once two came within it
STOP_TIMEOUT_S = 5.0


def _empty_camera_snapshot(buffer_stats: dict) -> dict:
    """camera_node.CameraNode.snapshot's keys before the child has reported (diagnostics reads them all)."""
    return {"received": 0, "accepted": 0, "rejected": 0, "rejected_by_reason": {}, "last_rejection": "",
            "last_rejection_age_s": None, "window_s": None, "rejected_recent": 0, "rejected_recent_by_reason": {},
            "rejection_rate_hz": 0.0, "dropped": buffer_stats["overwritten"], "buffer": buffer_stats,
            "rate_hz": 0.0, "deadline_missed": 0, "liveliness_lost": 0, "incompatible_qos": 0, "stalled": False,
            "frozen": False, "qos_mode": "", "callback_ms": LatencyStats(1).summary()}


class CameraProxy:
    """What the fleet node and the runtime hold for a robot's camera when it lives in the camera process:
    ``buffer`` (the loop reads it) and ``snapshot()`` (the child's last report, with the live buffer figures
    and the process's state under ``process``)."""

    def __init__(self, owner: "FleetCameraProcess", ns: str, buffer: SharedFrameBuffer) -> None:
        self.owner, self.ns, self.buffer = owner, ns, buffer

    def snapshot(self) -> dict:
        report = self.owner.last_report(self.ns)
        buf = self.buffer.stats()
        snap = dict(report) if report else _empty_camera_snapshot(buf)
        snap["buffer"], snap["dropped"] = buf, buf["overwritten"]
        snap["process"] = self.owner.process_state()
        return snap


class FleetCameraProcess:
    """Parent side: the shared buffers (one per robot), the child process, its reports, its restarts."""

    def __init__(self, robots: tuple[str, ...], camera_values: Mapping[str, Any], camera_topics: Mapping[str, str],
                 frame_bytes: int, log: Callable[[str], None] = print, error: Optional[Callable[[str], None]] = None,
                 status_period_s: float = 0.5, ros_args: Sequence[str] = ()) -> None:
        """``ros_args``: the edge's own ``--ros-args`` tokens (remaps, params files, log levels), given to the
        child's rclpy.init so its camera nodes see what they would have seen in the edge's process."""
        self._mp = multiprocessing.get_context("spawn")  # never fork a process with rclpy's threads in it
        self.robots = tuple(robots)
        self.camera_values = dict(camera_values)
        self.camera_topics = dict(camera_topics)
        self.status_period_s = float(status_period_s)
        self.ros_args = [str(a) for a in ros_args]
        self.log, self.error = log, error or log
        self.buffers: dict[str, SharedFrameBuffer] = {}
        try:
            for ns in self.robots:
                self.buffers[ns] = SharedFrameBuffer.create(frame_bytes, self._mp.Lock())
        except Exception:
            self.close()
            raise
        self.cameras = {ns: CameraProxy(self, ns, self.buffers[ns]) for ns in self.robots}
        self._proc = None
        self._conn = None
        self._reports: dict[str, dict] = {}
        self._report_lock = threading.Lock()  # poll() runs on a timer, snapshot() on the diagnostics threads
        self.started = self.restarts = 0  # starts in all (the first and every restart), and restarts
        self.last_exit: Optional[str] = None
        self.last_report_at: Optional[float] = None
        self._restart_times: list[float] = []
        self._stopping = False

    # ---- the child's life -------------------------------------------------------------------------------------
    def start(self) -> None:
        parent_conn, child_conn = self._mp.Pipe(duplex=True)
        specs = {ns: buf.spec() for ns, buf in self.buffers.items()}
        proc = self._mp.Process(target=camera_process_main, name="vla_fleet_cameras", daemon=True,
                                args=(self.robots, self.camera_values, self.camera_topics, specs, child_conn,
                                      self.status_period_s, self.ros_args))
        proc.start()
        child_conn.close()  # ours closed: the child sees EOF only when this process's end closes
        self._proc, self._conn = proc, parent_conn
        self.started += 1
        self._stopping = False
        self.log(f"fleet cameras: process {proc.pid} started for {len(self.robots)} robots (shared frame buffers "
                 f"of {self.buffers[self.robots[0]].slot_bytes} bytes per slot)" if self.robots else
                 f"fleet cameras: process {proc.pid} started")

    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def poll(self, now: Optional[float] = None) -> None:
        """Take the child's reports; restart it when it died (module docstring: supervision)."""
        self._drain()
        if self._proc is None or self._stopping or self._proc.is_alive():
            return
        now = time.monotonic() if now is None else now
        if self.last_exit is None:
            self.last_exit = f"exit code {self._proc.exitcode}"
            self.error(f"fleet cameras: process {self._proc.pid} exited ({self.last_exit}): every robot's camera "
                       "is down until it is restarted")
        self._restart_times = [t for t in self._restart_times if now - t < RESTART_BACKOFF_S]
        if len(self._restart_times) >= 2:
            return  # backing off: two restarts within RESTART_BACKOFF_S already
        self._restart(now)

    def _restart(self, now: float) -> None:
        self._close_conn()
        for buf in self.buffers.values():  # the dead child may hold its lock: both sides take a new one
            buf.renew_lock(self._mp.Lock())
            buf.clear_reading()
        with self._report_lock:
            self._reports = {}
        self._restart_times.append(now)
        self.restarts += 1
        self.start()
        self.last_exit = None

    def _drain(self) -> None:
        conn = self._conn
        if conn is None:
            return
        latest = None
        try:
            while conn.poll():
                latest = conn.recv()
        except (EOFError, OSError):
            pass  # the child is gone: poll() notices by its exit
        if isinstance(latest, dict) and isinstance(latest.get("cameras"), dict):
            with self._report_lock:
                self._reports = latest["cameras"]
                self.last_report_at = time.monotonic()

    def last_report(self, ns: str) -> Optional[dict]:
        with self._report_lock:
            return self._reports.get(ns)

    def process_state(self) -> dict:
        proc = self._proc
        age = None if self.last_report_at is None else time.monotonic() - self.last_report_at
        alive = self.alive()
        last_exit = self.last_exit or ""
        if proc is not None and not alive and not last_exit and proc.exitcode is not None:
            last_exit = f"exit code {proc.exitcode}"  # died since the last poll(): say how already
        return {"pid": None if proc is None else proc.pid, "alive": alive, "restarts": self.restarts,
                "last_exit": last_exit, "report_age_s": age}

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Ask the child to stop, wait, then terminate / kill it; idempotent."""
        self._stopping = True
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                if self._conn is not None:
                    self._conn.send("stop")
            except (OSError, ValueError):
                pass
            proc.join(timeout_s)
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        self._close_conn()

    def _close_conn(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def close(self) -> None:
        """stop(), then unlink the shared buffers."""
        self.stop()
        for buf in self.buffers.values():
            buf.close()
        self.buffers = {}


# ---- the child process ------------------------------------------------------------------------------------------
def ros_args_of(argv: Sequence[str]) -> list[str]:
    """The tokens of every ``--ros-args ... [--]`` block of a command line (what rclpy.init parsed in the edge)."""
    out, inside = [], False
    for tok in argv:
        if tok == "--ros-args":
            inside = True
        elif tok == "--":
            inside = False
        elif inside:
            out.append(tok)
    return out


def camera_process_main(robots, camera_values, camera_topics, specs, conn, status_period_s, ros_args=()) -> None:
    """The camera process: one ``SharedBufferCameraNode`` per robot, each spun by its own SingleThreadedExecutor
    in its own thread (the runtime's rule), and a report of every camera's snapshot through ``conn`` every
    ``status_period_s``. Ends on "stop" or when ``conn`` closes."""
    import rclpy
    from rclpy.context import Context
    from rclpy.signals import SignalHandlerOptions

    from vla_edge_ros.ros.executors import spin_each, stop_spinning

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent stops us in order
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    context = Context()
    rclpy.init(args=["vla_fleet_cameras", "--ros-args", *ros_args] if ros_args else None, context=context,
               signal_handler_options=SignalHandlerOptions.NO)
    buffers = {ns: SharedFrameBuffer.attach(path, lock) for ns, (path, lock) in specs.items()}
    nodes, executors, threads, orphaned = {}, [], [], []
    try:
        for ns in robots:
            overrides = camera_parameter_overrides({**camera_values, "camera_topic": camera_topics[ns]})
            nodes[ns] = SharedBufferCameraNode(buffers[ns], namespace="/" + ns, context=context,
                                               parameter_overrides=overrides)
        executors, threads = spin_each(nodes.values(), context)

        def watch_parent():  # "stop", or EOF: the parent is gone
            try:
                while not stop.is_set():
                    if conn.poll(0.2) and conn.recv() == "stop":
                        break
            except (EOFError, OSError):
                orphaned.append(True)
            stop.set()

        threading.Thread(target=watch_parent, name="parent_watch", daemon=True).start()
        while not stop.wait(status_period_s):
            try:
                conn.send({"pid": os.getpid(), "cameras": {ns: _plain(n.snapshot()) for ns, n in nodes.items()}})
            except (OSError, ValueError, BrokenPipeError):
                break
    finally:
        stop_spinning(executors, threads, shutdown_timeout_s=1.0, join_timeout_s=2.0)
        for node in nodes.values():
            node.destroy_node()
        try:
            context.try_shutdown()
        except Exception:
            pass
        for buf in buffers.values():
            buf.close()
            if orphaned:  # the parent died without unlinking its buffers: nobody else will
                try:
                    os.unlink(buf.path)
                except OSError:
                    pass


def _plain(x: Any) -> Any:
    """A snapshot as plain Python values: numpy scalars made Python numbers (the edge's stats JSON would write a
    numpy integer as a string); NaN stays (the diagnostics format it)."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if hasattr(x, "item") and callable(x.item):  # numpy scalars
        return x.item()
    return x


class SharedBufferCameraNode(CameraNode):
    """camera_node.CameraNode writing into a SharedFrameBuffer: a frame larger than its slots is rejected by name
    (``too_large_for_buffer``), counted as every rejection is."""

    def _convert(self, msg, convert):
        img = super()._convert(msg, convert)
        if img.nbytes > self.buffer.slot_bytes:
            raise image_convert.ImageRejected(
                "too_large_for_buffer", f"{img.shape} RGB is {img.nbytes} bytes, the fleet's shared frame buffer "
                f"holds {self.buffer.slot_bytes} (raise fleet_frame_bytes on the edge)")
        return img
