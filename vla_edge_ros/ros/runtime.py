"""`vla_runtime`: the camera, inference and action nodes in one process (or one side of a robot/edge split).

Roles (``--role``):
- ``all``   (default) vla_camera + vla_inference + vla_action in ONE process, sharing the DoubleBuffer (camera
            -> inference) and the ActionArbiter (inference -> action) as plain Python objects: no
            serialisation, no DDS hop, camera ingest / inference / the 30 Hz timer never wait on each other;
- ``edge``  vla_camera + vla_inference; each fresh action is published on ``fresh_action_topic``. With
            ``robot_namespaces`` set (``-p robot_namespaces:=r1,r2,r3``) it is the fleet edge instead
            (ros/fleet_node.py, issue 24): one vla_inference serving every robot with one batched engine, and
            per robot ``<ns>`` a camera node ``/<ns>/vla_camera`` on ``/<ns><camera_topic>`` and fresh actions
            on ``/<ns><fresh_action_topic>``;
- ``robot`` vla_action only; it subscribes ``fresh_action_topic`` and keeps its own 30 Hz timer.

Threads: one SingleThreadedExecutor per node, each in its own thread, and the inference loop in its own thread.
Why not rclpy's MultiThreadedExecutor: measured on this 2-core machine it let the 30 Hz timer miss up to 76 % of
its ticks and stall for up to 2.7 s (its callback scheduling contends on the GIL and one task queue), while one
SingleThreadedExecutor per node kept the timer's period error p99 <= 1.4 ms.

The inference node is a lifecycle node: by default it is brought to 'active' at start (``--no-autostart``
leaves it 'unconfigured' for an external lifecycle manager). SIGINT/SIGTERM stop everything in order (inference
loop, executors, nodes) and, with ``--stats-out FILE``, the run's figures are written as JSON (the demo, sweep
and soak read them).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import rclpy
from rclpy.context import Context
from rclpy.executors import SingleThreadedExecutor
from rclpy.signals import SignalHandlerOptions
from rclpy.utilities import remove_ros_args

from vla_edge_ros import params as registry
from vla_edge_ros.core.double_buffer import DoubleBuffer
from vla_edge_ros.core.gc_pauses import GcPauseMonitor, freeze_long_lived
from vla_edge_ros.core.metrics import peak_rss_mb
from vla_edge_ros.ros import diagnostics
from vla_edge_ros.ros.executors import spin_each, stop_spinning

ROLES = ("all", "edge", "robot")


def _params_file_entries(argv: list[str], node: str):
    """(name, value) of ``node``'s sections ('/**', node, '/node') in each ``--params-file`` of argv, in order."""
    import yaml

    for i, a in enumerate(argv):
        if a == "--params-file" and i + 1 < len(argv):
            try:
                with open(argv[i + 1], encoding="utf-8") as f:
                    doc = yaml.safe_load(f) or {}
            except OSError:
                continue
            for key in ("/**", node, "/" + node):
                yield from ((doc.get(key) or {}).get("ros__parameters", {}) or {}).items()


def params_file_value(argv: list[str], node: str, name: str) -> Any:
    """A parameter value from the ``--params-file`` files in ``argv`` (last one wins), else None.

    Used for ``fresh_action_topic`` on the robot side, which runs no inference node: the same YAML then
    configures both sides of a split."""
    value = None
    for key, v in _params_file_entries(argv, node):
        if key == name:
            value = v
    return value


def given_values(argv: list[str], node: str) -> dict[str, Any]:
    """``node``'s registry parameters given in ``argv`` before any node exists: the params files' sections, then
    ``-p name:=value`` (which rcl applies over the files). Used to choose the fleet edge (``robot_namespaces``)
    and to hand the ``vla_camera`` values to every robot's camera node (whose node name is namespaced, so the
    file's ``vla_camera`` section would not reach it)."""
    import yaml

    names = {s.name for s in registry.for_node(node)}
    values = {k: v for k, v in _params_file_entries(argv, node) if k in names}
    for flag, arg in zip(argv, argv[1:]):
        if flag in ("-p", "--param") and ":=" in arg:
            key, text = arg.split(":=", 1)
            if key in names:
                try:
                    values[key] = yaml.safe_load(text)  # rcl reads a -p value as YAML too
                except yaml.YAMLError:
                    values[key] = text
    return values


def _nan_to_none(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_nan_to_none(v) for v in obj]
    return obj


# CPython hands the GIL to a waiting thread only every "switch interval" (default 5 ms): with the inference thread
# busy in Python code, the 30 Hz timer and the camera callback waited up to that long for the GIL. A shorter
# interval bounds that wait; the extra switching costs the inference thread little (measured with
# bench/runtime_bench.py, see README). VLA_SWITCH_INTERVAL_S overrides it (0 keeps CPython's default).
GIL_SWITCH_INTERVAL_S = float(os.environ.get("VLA_SWITCH_INTERVAL_S", "0.001"))
QUIET_POINT_TIMEOUT_S = 0.1  # longest a stats / diagnostics collection waits for a gap between fleet passes
# The process freezes what start-up allocated out of the cyclic collector's full passes (core/gc_pauses.py says
# why) between configure and activate: the gc.collect() before the freeze stops every thread for 13-50 ms, and
# before activation no chunk is admitted and no tick is due. Done 3 s after activation instead (sessions 19-24),
# that collect was the one late pass of the 8-robot H200 replays (a 13-22 ms generation-2 pause, the same length
# as the pass's stall). VLA_GC_FREEZE=0 leaves the collector as it is.
GC_FREEZE = os.environ.get("VLA_GC_FREEZE", "1") != "0"


class Runtime:
    """Builds the nodes of one role, spins them, collects figures. Usable in-process (tests, benches)."""

    def __init__(self, role: str = "all", context: Optional[Context] = None, autostart: bool = True,
                 fresh_action_topic: Optional[str] = None, parameter_overrides: Optional[dict] = None,
                 given: Optional[dict[str, dict]] = None):
        """``given``: node -> parameter values from the command line (``given_values``), for what must be known
        before the nodes exist: role edge serves a fleet when ``robot_namespaces`` is set (there or in
        ``parameter_overrides``); the fleet's camera nodes take the ``vla_camera`` values."""
        if GIL_SWITCH_INTERVAL_S > 0:
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        if role not in ROLES + ("camera",):
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        from vla_edge_ros.ros.action_node import ActionNode
        from vla_edge_ros.ros.camera_node import CameraNode
        from vla_edge_ros.ros.inference_node import InferenceNode

        self.role = role
        self.autostart = autostart
        self.context = context
        self.buffer: DoubleBuffer = DoubleBuffer()
        self.camera = self.inference = self.action = None
        kw: dict[str, Any] = {"context": context}
        overrides = parameter_overrides or {}
        given = given or {}
        robot_namespaces = overrides.get("robot_namespaces",
                                         given.get(registry.INFERENCE, {}).get("robot_namespaces", ""))
        fleet = role == "edge" and bool(str(robot_namespaces).strip())
        self.fleet = None

        def node_kw(node: str) -> dict:
            from rclpy.parameter import Parameter
            ov = [Parameter(k, value=v) for k, v in overrides.items() if registry.BY_NAME[k].node == node]
            return {**kw, "parameter_overrides": ov} if ov else kw

        if role in ("all", "robot"):
            self.action = ActionNode(fresh_action_topic=fresh_action_topic if role == "robot" else None,
                                     **node_kw(registry.ACTION))
        arbiter = self.action.arbiter if self.action is not None else None
        if role in ("all", "edge", "camera") and not fleet:
            self.camera = CameraNode(self.buffer, arbiter=arbiter, **node_kw(registry.CAMERA))
        if fleet:  # the robots' camera subscriptions live in the fleet node (its camera nodes)
            from vla_edge_ros.ros.fleet_node import FleetNode
            camera_values = {**given.get(registry.CAMERA, {}),
                             **{k: v for k, v in overrides.items() if registry.BY_NAME[k].node == registry.CAMERA}}
            self.inference = self.fleet = FleetNode(camera_values, **node_kw(registry.INFERENCE))
        elif role in ("all", "edge"):
            self.inference = InferenceNode(
                self.buffer, arbiter=arbiter, publish_fresh=(role == "edge"),
                on_action_names=self.action.set_action_names if self.action is not None else None,
                action_rate_hz=(lambda: self.action.params.get("action_rate_hz")) if self.action is not None
                else None,
                chunk_step_hz=(lambda: self.action.params.get("chunk_step_hz")) if self.action is not None
                else None,
                **node_kw(registry.INFERENCE))
        if self.action is not None and self.inference is not None:
            self.action.on_rate_change = self.inference.set_cycle_rate
        declared = self.inference.params.get("robot_namespaces") if self.inference is not None else ""
        if declared.strip() and self.fleet is None:  # given where this process could not read it ahead
            raise ValueError(f"robot_namespaces={declared!r} is served by --role edge only (this is role {role}), "
                             "given with -p or in a params file's vla_inference or /** section (read before the "
                             "nodes are built)")
        self.nodes = [n for n in (self.camera, self.inference, self.action) if n is not None]
        if self.fleet is not None:
            self.nodes += self.fleet.camera_nodes()
        sources = []
        if self.camera is not None:
            sources.append(lambda: diagnostics.camera_status(self.camera.snapshot()))
        if self.fleet is not None:
            sources += self._fleet_sources(self.fleet)
        elif self.inference is not None:
            sources.append(lambda: diagnostics.inference_status(self.inference.snapshot()))
        if self.action is not None:
            sources.append(lambda: diagnostics.action_status(self.action.snapshot()))
        sources.append(lambda: diagnostics.memory_status())
        # On the inference node when there is one: its executor only serves lifecycle/parameter services
        # (inference runs in its own thread), so the 1 Hz aggregation never delays camera or the 30 Hz timer.
        host = self.inference or self.camera or self.action
        self.diagnostics = diagnostics.DiagnosticsPublisher(host, sources, before_build=self.quiet_point)
        self.executors: list[SingleThreadedExecutor] = []
        self.threads: list[threading.Thread] = []
        self.started_at = time.monotonic()
        self.active_since: Optional[float] = None
        self.gc_monitor = GcPauseMonitor().install()
        self.gc_freeze: Optional[dict] = None  # freeze_long_lived()'s figures once done

    @staticmethod
    def _fleet_sources(fleet) -> list:
        """The fleet engine's status, then per robot its camera's and its own (one status each)."""
        sources = [lambda: diagnostics.fleet_status(fleet.snapshot())]
        for ns, cam in fleet.cameras.items():
            sources.append(lambda ns=ns, cam=cam: diagnostics.robot_camera_status(ns, cam.snapshot()))
            sources.append(lambda ns=ns: diagnostics.fleet_robot_status(ns, fleet.robot_snapshot(ns),
                                                                        fleet.current_state_label()))
        return sources

    def quiet_point(self, timeout_s: float = QUIET_POINT_TIMEOUT_S) -> bool:
        """Before figures are collected and written (stats file, /diagnostics): on the fleet edge, wait for a gap
        between passes so that this Python work does not take the GIL from a pass (core/fleet_loop.py,
        ``wait_between_passes``); elsewhere return at once."""
        wait = getattr(self.inference, "wait_between_passes", None)
        return True if wait is None else wait(timeout_s)

    # ---- lifecycle of the process ---------------------------------------------------------------------
    def start(self) -> None:
        self.executors, self.threads = spin_each(self.nodes, self.context)
        self.started_at = time.monotonic()
        if self.inference is not None and self.autostart:
            self.bring_up()
        else:
            self.active_since = self.started_at

    def bring_up(self) -> bool:
        ok = self.inference.safe_transition("configure")
        if ok and GC_FREEZE and self.gc_freeze is None:  # the engine is loaded and warm; nothing runs yet
            self.gc_freeze = freeze_long_lived()
        ok = ok and self.inference.safe_transition("activate")
        self.active_since = time.monotonic()
        if not ok:
            self.inference.get_logger().error(f"autostart did not reach 'active' "
                                              f"({self.inference.last_error or 'see log'})")
        return ok

    def stop(self) -> None:
        if self.inference is not None:
            try:
                self.inference.safe_transition("shutdown")
            except Exception as exc:
                print(f"[vla_runtime] inference shutdown: {exc!r}", file=sys.stderr)
        stop_spinning(self.executors, self.threads)

    def destroy(self) -> None:
        self.gc_monitor.uninstall()
        self.diagnostics.destroy()
        for node in self.nodes:
            node.destroy_node()

    # ---- figures --------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        now = time.monotonic()
        out: dict[str, Any] = {
            "role": self.role,
            "duration_s": now - (self.active_since or self.started_at),
            "wall_s": now - self.started_at,
        }
        if self.action is not None:
            a = self.action.snapshot()
            out["ticks"] = a["ticks"]
            out["timer_period_error_ms"] = {k: a["timer_period_error_ms"][k] for k in ("p50", "p99")}
            out["action"] = a
        if self.inference is not None:
            i = self.inference.snapshot()
            out["backend"] = i["backend"]
            out["chunks"] = {"admitted": i["admitted"], "refused": i["refused"],
                             "deadline_misses": i["deadline_misses"]}
            out["latency_ms"] = {k: i["latency_ms"][k] for k in ("p50", "p95", "p99")}
            kv = i["kv"]
            out["kv"] = {"policy": kv["policy"], "budget_tokens": kv["budget_tokens"],
                         "max_occupancy_tokens": kv["max_occupancy_tokens"]}
            out["inference"] = i
            if "robots" in i:  # the fleet edge: per robot figures at the top, as a single edge's are
                out["robots"] = {ns: {"fresh_actions": r["fresh_actions"], "admitted": r["loop"].get("admitted", 0),
                                      "refused_deadline": r["loop"].get("refused_deadline", 0),
                                      "refused_capacity": r["loop"].get("refused_capacity", 0),
                                      "deadline_misses": r["loop"].get("deadline_misses", 0),
                                      "frames_received": r["camera"].get("received", 0)}
                                 for ns, r in i["robots"].items()}
        if self.camera is not None:
            c = self.camera.snapshot()
            out["frames"] = {"received": c["received"], "dropped": c["dropped"], "rejected": c["rejected"],
                             "rejected_by_reason": c["rejected_by_reason"]}
            out["camera"] = c
        out["gc"] = {**self.gc_monitor.snapshot(), "freeze": self.gc_freeze}
        out["memory"] = {"peak_rss_mb": peak_rss_mb(),
                         "peak_vram_mb": self.inference.peak_vram_mb if self.inference is not None else 0.0}
        return _nan_to_none(out)


def write_stats(path: str, stats: dict, indent: Optional[int] = None) -> None:
    """Atomically (write, then rename). Compact by default: the periodic files are for tools, and json's indented
    form runs its pure-Python encoder (5x the time, measured on the fleet edge's 265 KB stats); the final file is
    indented for people."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(stats, indent=indent, default=str, separators=None if indent else (",", ":")))
    os.replace(tmp, p)


def run(role: str, argv: list[str], autostart: bool = True, stats_out: Optional[str] = None,
        fresh_action_topic: Optional[str] = None, duration_s: Optional[float] = None,
        stats_every_s: Optional[float] = None) -> int:
    # Our own SIGINT/SIGTERM handling: stop in order (inference first, then executors), then write stats.
    rclpy.init(args=argv, signal_handler_options=SignalHandlerOptions.NO)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if role == "robot" and not fresh_action_topic:
        fresh_action_topic = (params_file_value(argv, registry.INFERENCE, "fresh_action_topic")
                              or registry.BY_NAME["fresh_action_topic"].default)
    try:
        rt = Runtime(role, autostart=autostart, fresh_action_topic=fresh_action_topic,
                     given={node: given_values(argv, node) for node in (registry.CAMERA, registry.INFERENCE)})
    except Exception as exc:
        print(f"vla_runtime: cannot start: {exc}", file=sys.stderr)
        rclpy.try_shutdown()
        return 2
    rt.start()
    rc = 0
    t_end = None if duration_s is None else time.monotonic() + duration_s
    while not stop.is_set():
        timeout = 1.0 if stats_every_s is None else stats_every_s
        if t_end is not None:
            timeout = min(timeout, max(0.0, t_end - time.monotonic()))
        if stop.wait(timeout):
            break
        if stats_out and stats_every_s is not None:
            rt.quiet_point()
            write_stats(stats_out, rt.stats())
        if t_end is not None and time.monotonic() >= t_end:
            break
    final = rt.stats()  # before stopping: figures of the running system
    rt.stop()
    if stats_out:
        write_stats(stats_out, final, indent=2)
    rt.destroy()
    rclpy.try_shutdown()
    return rc


def role_from_ros_args(argv: list[str]) -> Optional[str]:
    """``--ros-args -p role:=edge`` (the ROS-parameter way of choosing the role); None when absent."""
    role = None
    for flag, value in zip(argv, argv[1:]):
        if flag in ("-p", "--param") and value.startswith("role:="):
            role = value.split(":=", 1)[1].strip().strip("'\"")
    return role


def parse_args(argv: list[str], default_role: str = "all") -> argparse.Namespace:
    default_role = role_from_ros_args(argv) or os.environ.get("VLA_ROLE", default_role)
    if default_role not in ROLES:
        raise SystemExit(f"vla_runtime: role must be one of {', '.join(ROLES)}, got {default_role!r}")
    ap = argparse.ArgumentParser(prog="vla_runtime", description="VLA runtime: camera + inference + action nodes")
    ap.add_argument("--role", choices=ROLES, default=default_role,
                    help="all (one process), edge (camera + inference) or robot (action publisher)")
    ap.add_argument("--lifecycle-autostart", dest="autostart", action="store_true", default=True,
                    help="bring vla_inference to 'active' at start (default)")
    ap.add_argument("--no-autostart", dest="autostart", action="store_false",
                    help="leave vla_inference 'unconfigured' for an external lifecycle manager")
    ap.add_argument("--stats-out", default=None, help="write the run's figures as JSON here at shutdown")
    ap.add_argument("--stats-every-s", type=float, default=None, help="also rewrite --stats-out this often")
    ap.add_argument("--fresh-action-topic", default=None,
                    help="robot role: topic of fresh actions (default: vla_inference.fresh_action_topic from "
                         "the params file, else the registry default)")
    ap.add_argument("--duration-s", type=float, default=None, help="exit by itself after this long")
    return ap.parse_args(remove_ros_args(argv)[1:])


def main(args: Optional[list[str]] = None) -> int:
    argv = list(sys.argv if args is None else args)
    opts = parse_args(argv)
    return run(opts.role, argv, opts.autostart, opts.stats_out, opts.fresh_action_topic, opts.duration_s,
               opts.stats_every_s)


def run_single(kind: str, args: Optional[list[str]] = None) -> int:
    """Entry point of the single-node executables (vla_camera, vla_inference, vla_action)."""
    argv = list(sys.argv if args is None else args)
    role = {"camera": "camera", "inference": "edge", "action": "robot"}[kind]
    ap = argparse.ArgumentParser(prog=f"vla_{kind}")
    ap.add_argument("--stats-out", default=None)
    ap.add_argument("--no-autostart", dest="autostart", action="store_false", default=True)
    ap.add_argument("--fresh-action-topic", default=None)
    opts = ap.parse_args(remove_ros_args(argv)[1:])
    return run(role, argv, opts.autostart, opts.stats_out, opts.fresh_action_topic)


# ---- the single-node executables (setup.py entry points): here, so node modules never import the runtime ----
def camera_main(args: Optional[list[str]] = None) -> int:
    """vla_camera: Stand-alone camera subscriber: ingest + /diagnostics only (useful to check a camera stream)."""
    return run_single("camera", args)


def inference_main(args: Optional[list[str]] = None) -> int:
    """vla_inference: Stand-alone inference node. It needs frames in-process (double buffer), so this is role edge: camera
    subscriber + lifecycle inference node, fresh actions published on ``fresh_action_topic``."""
    return run_single("inference", args)


def action_main(args: Optional[list[str]] = None) -> int:
    """vla_action: Stand-alone action publisher = role robot (fresh actions from ``fresh_action_topic``)."""
    return run_single("action", args)


if __name__ == "__main__":
    sys.exit(main())
