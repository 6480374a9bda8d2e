"""The fleet edge (issue 24): ``vla_runtime --role edge`` with ``robot_namespaces`` set serves N robots from one
engine, one batched forward pass per cycle.

Why a node of its own: the single-robot edge (inference_node.py) pairs one camera buffer with one engine and one
fresh-action publisher; a fleet needs those per robot and one engine shared by all. This node is that inference
node (a subclass: the same lifecycle transitions, RCLError guard, sticky / recovering errors, node name
``vla_inference``, so lifecycle tools and the ``vla_inference`` section of a params file work unchanged) with:

- per robot ``<ns>``: a camera node named ``/<ns>/vla_camera`` (camera_node.CameraNode's validation, stall /
  liveliness / frozen detection and figures) subscribing ``/<ns><camera_topic>`` into the robot's own frame buffer,
  in the cameras' own process (ros/fleet_cameras.py, the default) or in this one (below), and a fresh-action
  publisher on ``/<ns><fresh_action_topic>`` with the message and QoS of the single edge, so
  ``vla_runtime --role robot`` runs unchanged on each robot (docs/OPERATIONS.md "One edge, many robots"); the
  camera nodes take the camera values given to ``vla_camera`` (the runtime passes them) and are spun by the
  runtime like any node;
- one batched engine (backend numpy: engine/fleet_numpy.FleetNumpyEngine; cuda: engine/cuda/fleet.FleetCudaEngine,
  a KV region per listed robot; one copy of the weights either way), one FleetScheduler (per-robot deadline
  admission, earliest deadline first, starvation counted and promoted) and one FleetLoop (its own thread).

Transitions: configure builds engine, scheduler and loop, warms up every batch size up to the fleet's (the
scheduler must have measured a size to batch it) and adds every robot of ``robot_namespaces`` (a robot whose
KV cache cannot be allocated is refused alone: ERROR in its status, the others are served); activate starts /
resumes the loop; deactivate pauses it (every robot's publisher repeats, then holds); cleanup / shutdown stop it
and free the engine. A robot that goes silent stays added: its camera stops, its buffer holds nothing new, it is
simply not ready; nobody else notices. A robot process killed and restarted is nothing to this node either: its
publisher keeps publishing and the new subscriber matches.

In-process cameras (``fleet_camera_process:=false``): ros/fleet_camera_node.FleetCameraNode, which leaves JPEG /
YUV decoding to the fleet loop.

Not yet: live changes of the loop's parameters (refused with the reason; stored while unconfigured), robots
joining at run time (the list is read-only; FleetLoop supports it); backend cuda with quantised weights or parallel
chunk decoding (refused by name: engine/cuda/fleet.fleet_unsupported_reason).
"""
from __future__ import annotations

import math
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from rclpy.lifecycle import LifecycleState, TransitionCallbackReturn
from sensor_msgs.msg import JointState

from vla_edge_ros import params as registry
from vla_edge_ros.core.double_buffer import DoubleBuffer
from vla_edge_ros.core.metrics import LatencyStats, RateCounter, current_rss_mb
from vla_edge_ros.ros import conversions, qos
from vla_edge_ros.ros.camera_node import camera_parameter_overrides
from vla_edge_ros.ros.fleet_camera_node import FleetCameraNode
from vla_edge_ros.ros.inference_node import LOOP_PARAMS, InferenceNode

_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# a robot's status may come from a fleet snapshot this old (/diagnostics builds every robot's right after it)
ROBOT_SNAPSHOT_MAX_AGE_S = 0.25
# robot-scoped events that are that robot's fault only (ERROR in its own status, not the fleet's)
ROBOT_ERRORS = ("chunk_error", "bad_frame", "robot_add_failed", "robot_remove_failed", "action_callback_error")


def parse_robot_namespaces(text: Any) -> tuple[str, ...]:
    """``"r1, r2,/fleet/r3"`` -> ``("r1", "r2", "fleet/r3")``; ``""`` -> ``()``. ValueError naming the bad entry
    (not a ROS namespace, reserved ``__``, listed twice, or not a string: ``-p robot_namespaces:=[r1,r2]`` is a
    list, the parameter is one comma-separated string)."""
    if not isinstance(text, str):
        raise ValueError(f"robot_namespaces must be one comma-separated string ('r1,r2,r3'), got "
                         f"{type(text).__name__} {text!r}")
    if not text.strip():
        return ()
    names: list[str] = []
    for item in text.split(","):
        ns = item.strip().strip("/")
        tokens = ns.split("/")
        if not ns or not all(_TOKEN.match(t) and "__" not in t for t in tokens):
            raise ValueError(f"robot_namespaces: {item.strip()!r} is not a robot namespace (tokens of letters, "
                             f"digits and '_', not starting with a digit, no '__', '/'-separated) in {text!r}")
        if ns in names:
            raise ValueError(f"robot_namespaces: {ns!r} is listed twice in {text!r}")
        names.append(ns)
    return tuple(names)


def robot_topic(ns: str, topic: str) -> str:
    """``/<ns>`` + the configured topic: ``robot_topic("r1", "/vla/action_fresh") == "/r1/vla/action_fresh"``."""
    return f"/{ns}/{topic.strip('/')}"


def build_fleet_engine(values: Mapping[str, Any], log: Callable[[str], None] = print):
    """engine/factory.make_engine's checks and loading, for the batched fleet engine of ``backend`` (auto: numpy):
    one KV manager per robot, each with the full ``kv_budget_tokens`` (0: the backend's default), built by the
    engine as robots join; the CUDA engine holds a KV region for each robot of ``robot_namespaces``."""
    from vla_edge_ros.core.kv.manager import KVManager
    from vla_edge_ros.engine import factory
    from vla_edge_ros.engine.checkpoint import load_checkpoint
    from vla_edge_ros.engine.config import ModelConfig
    from vla_edge_ros.engine.fleet_numpy import FleetNumpyEngine
    from vla_edge_ros.engine.geometry import (check_decode_tokens, check_positions, check_tokens_per_frame,
                                              prefix_token_ids)
    from vla_edge_ros.engine.interface import EngineError

    v = {**registry.defaults(registry.INFERENCE), **{k: values[k] for k in factory.ENGINE_PARAMS if k in values}}
    backend = "cuda" if v["backend"] == "cuda" else "numpy"
    if v["backend"] == "auto":
        log("fleet engine: backend=auto serves the fleet with numpy (backend:=cuda for the batched CUDA pass)")
    prefix = len(prefix_token_ids(v["instruction"]))
    reasons = registry.validate_all(v, prefix_tokens=prefix)
    if reasons:
        raise EngineError("invalid engine parameters: " + "; ".join(reasons))
    ckpt = factory.resolve_checkpoint(v["checkpoint"])
    cfg = ModelConfig.from_json(ckpt)
    tpf, dec, dtype = v["tokens_per_frame"], v["decode_tokens"], v["weight_dtype"]
    check_tokens_per_frame(cfg, tpf)
    check_decode_tokens(cfg, dec)
    prequantized = factory._check_prequantized(ckpt, dtype)  # the single engine's check, and its message
    budget = registry.resolve_kv_budget(v["kv_budget_tokens"], backend, tpf)
    check_positions(cfg, budget, dec)

    def kv_factory(name: str) -> KVManager:
        return KVManager(budget, tpf, prefix, policy=v["eviction_policy"], window_frames=v["window_frames"],
                         embed_dim=cfg.hidden_size)

    try:
        kv_factory("check")  # bad KV settings fail configure here, not as every robot's add failure
    except ValueError as exc:
        raise EngineError(f"KV manager: {exc}") from exc
    if backend == "cuda":
        from vla_edge_ros.engine.cuda.fleet import FleetCudaEngine
        robots = max(1, len(parse_robot_namespaces(values.get("robot_namespaces", ""))))
        log(f"fleet engine: cuda, checkpoint {ckpt}, {robots} robots x kv_budget_tokens {budget}, weight_dtype "
            f"{dtype}")
        return FleetCudaEngine(cfg, ckpt, kv_factory, instruction=v["instruction"], decode_tokens=dec,
                               max_robots=robots, budget_tokens=budget, max_vram_gb=v["max_vram_gb"], log=log,
                               weight_dtype=dtype, action_readout=v["action_readout"])
    if prequantized:
        from vla_edge_ros.engine.quant_checkpoint import read_quantized_checkpoint
        weights = read_quantized_checkpoint(ckpt, dtype)[1]
    else:
        weights = load_checkpoint(ckpt, cfg)
    log(f"fleet engine: numpy, checkpoint {ckpt}, kv_budget_tokens {budget} per robot, weight_dtype {dtype}")
    return FleetNumpyEngine(cfg, weights, kv_factory, instruction=v["instruction"], decode_tokens=dec,
                            weight_dtype=dtype, action_readout=v["action_readout"])


@dataclass
class _RobotFigures:
    fresh: int = 0
    rate: RateCounter = field(default_factory=lambda: RateCounter(1.0))
    frame_to_action_ms: LatencyStats = field(default_factory=lambda: LatencyStats(4096))
    errors: int = 0
    last_error: str = ""
    last_error_at: Optional[float] = None


class FleetNode(InferenceNode):
    NODE_NAME = registry.INFERENCE

    def __init__(self, camera_values: Optional[Mapping[str, Any]] = None, **node_kwargs):
        """``camera_values``: the ``vla_camera`` parameters given at start (params files, -p); every robot's
        camera node takes them, its ``camera_topic`` prefixed with the robot's namespace."""
        super().__init__(None, **node_kwargs)  # no shared frame buffer: each robot has its own
        self.robots = parse_robot_namespaces(self.params.get("robot_namespaces"))
        if not self.robots:
            raise ValueError("the fleet edge needs robot_namespaces (comma-separated robot namespaces)")
        self.scheduler = None
        self.buffers = {ns: DoubleBuffer() for ns in self.robots}
        self.figures = {ns: _RobotFigures() for ns in self.robots}
        self._snapshot_cache: Optional[tuple[float, dict]] = None  # (monotonic time, snapshot)
        self.cameras: dict[str, Any] = {}  # FleetCameraNode, or fleet_cameras.CameraProxy (camera process)
        self.camera_process = None
        self._camera_watch = None
        self.topics: dict[str, dict[str, str]] = {}
        self._fresh_pubs = {}
        camera_values = dict(camera_values or {})
        camera_topic = camera_values.get("camera_topic", registry.BY_NAME["camera_topic"].default)
        self.topics = {ns: {"camera_topic": robot_topic(ns, camera_topic),
                            "fresh_action_topic": robot_topic(ns, self.params.get("fresh_action_topic"))}
                       for ns in self.robots}
        try:
            if self.params.get("fleet_camera_process"):
                self._start_camera_process(camera_values)
            for ns in self.robots:
                if self.camera_process is None:
                    overrides = camera_parameter_overrides({**camera_values, **self.topics[ns]})
                    self.cameras[ns] = FleetCameraNode(self.buffers[ns], namespace="/" + ns,
                                                       context=node_kwargs.get("context"),
                                                       parameter_overrides=overrides)
                self._fresh_pubs[ns] = self.create_publisher(JointState, self.topics[ns]["fresh_action_topic"],
                                                             qos.reliable_qos())
        except Exception:
            self.destroy_cameras()
            raise
        where = (f"camera process {self.camera_process.process_state()['pid']}" if self.camera_process is not None
                 else "cameras in this process")
        self.get_logger().info(f"fleet edge: {len(self.robots)} robots ({', '.join(self.robots)}), {where}")

    def _start_camera_process(self, camera_values: dict) -> None:
        """The robots' cameras in a child process feeding shared buffers (ros/fleet_cameras.py says why)."""
        from vla_edge_ros.ros.fleet_cameras import FleetCameraProcess, ros_args_of
        log = self.get_logger()
        self.camera_process = FleetCameraProcess(
            self.robots, camera_values, {ns: t["camera_topic"] for ns, t in self.topics.items()},
            self.params.get("fleet_frame_bytes"), log=log.info, error=log.error, ros_args=ros_args_of(sys.argv))
        self.buffers = dict(self.camera_process.buffers)
        self.cameras = dict(self.camera_process.cameras)
        self.camera_process.start()
        self._camera_watch = self.create_timer(self.camera_process.status_period_s, self.camera_process.poll)

    def camera_nodes(self) -> list:
        """The camera nodes this process must spin (none when they live in the camera process)."""
        return [] if self.camera_process is not None else list(self.cameras.values())

    def destroy_cameras(self) -> None:
        if self._camera_watch is not None:
            self.destroy_timer(self._camera_watch)
            self._camera_watch = None
        if self.camera_process is not None:
            self.camera_process.close()
        else:
            for cam in self.cameras.values():
                cam.destroy_node()
        self.cameras = {}

    def destroy_node(self) -> None:
        if self.camera_process is not None:  # in-process camera nodes are the runtime's to destroy
            self.destroy_cameras()
        super().destroy_node()

    # ---- transitions (the rest is InferenceNode's) ----------------------------------------------------
    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        from vla_edge_ros.core.fleet_loop import FleetLoop
        from vla_edge_ros.core.fleet_scheduler import BatchCostModel, FleetScheduler
        from vla_edge_ros.engine.interface import Engine

        t0 = time.monotonic()
        try:
            values = dict(self.params.values)
            self.engine = build_fleet_engine(values, self.get_logger().info)
            self.backend = self.engine.name
            problem = Engine.chunk_support_problem(self.engine)  # the single engine's rule (cfg + name)
            if problem:
                raise RuntimeError(f"checkpoint refused: {problem}")
            self.action_names = self.engine.action_names
            self.action_horizon = int(getattr(self.engine.cfg, "action_horizon", 1))
            # a batch never holds more robots than are listed: warm-up measures exactly the sizes that can occur
            self.scheduler = FleetScheduler(min(values["fleet_max_batch"], len(self.robots)),
                                            values["safety_margin_ms"], values["fleet_starvation_limit"],
                                            BatchCostModel(values["ema_alpha"], values["cost_quantile"]),
                                            decode_steps=self.engine.decode_steps)
            self.loop = FleetLoop(self.engine, self.scheduler, self.cycle_period_ms(), values["deadline_ms"],
                                  on_action=self._on_fleet_action, on_event=self._on_fleet_event,
                                  saliency_threshold=values["saliency_threshold"], thread_name="vla_fleet_loop")
            self.warmup_stats = self.loop.warmup(values["warmup_chunks"])
            for ns in self.robots:
                self.loop.add_robot(ns, self.buffers[ns])
            self.loop.apply_pending_membership()  # here, before the loop's thread exists: the engine is ours
        except Exception as exc:
            self._release()
            return self._fail("configure", exc)
        self.last_error, self.last_error_at, self.last_error_sticky = "", None, False
        self._succeeded("configure")
        self.get_logger().info(f"configured: fleet of {len(self.loop.robots)}/{len(self.robots)} robots, backend "
                               f"{self.backend}, batches up to {self.scheduler.max_batch}, warm-up "
                               f"{values['warmup_chunks']} passes per size, {time.monotonic() - t0:.1f} s")
        return TransitionCallbackReturn.SUCCESS

    def _release(self) -> None:
        self.scheduler = None
        super()._release()

    def _prefix_tokens(self) -> int:
        engines = getattr(self.engine, "robots", None) or {}
        for eng in list(engines.values()):
            return int(eng.prefix_tokens)
        return len(self.params.get("instruction").encode("utf-8"))

    def _on_params(self, changes: dict) -> None:
        refused = sorted(k for k in changes if k in LOOP_PARAMS)
        if self.loop is not None and refused:  # raising: the ParamBridge refuses the change with this reason
            raise ValueError(f"the fleet edge does not apply live changes of {', '.join(refused)} yet (issue 24): "
                             "cleanup + configure with the new value")

    # ---- fleet-loop callbacks (its thread) ------------------------------------------------------------
    def _on_fleet_action(self, name: str, result: Any) -> None:
        now_ns = self.get_clock().now().nanoseconds
        stamp_ns = int(getattr(result, "frame_stamp_ns", 0) or 0)
        chunk = getattr(result, "chunk", None)
        if chunk is None:  # a bare action (H = 1)
            chunk = getattr(result, "action", result)
        fig = self.figures[name]
        fig.fresh += 1
        fig.rate.add()
        self.fresh_count += 1
        self.fresh_rate.add()
        if stamp_ns:
            fig.frame_to_action_ms.add(max(0.0, (now_ns - stamp_ns) / 1e6))
            self.frame_to_action_ms.add(max(0.0, (now_ns - stamp_ns) / 1e6))
        self._fresh_pubs[name].publish(conversions.fresh_chunk_to_msg(chunk, stamp_ns, self.action_names, fig.fresh))

    def _on_fleet_event(self, name: Optional[str], kind: str, detail: dict) -> None:
        if kind == "started":
            self._lower_thread_priority(int(self.params.get("inference_thread_nice")))
            return
        if kind in ("robot_added", "robot_removed"):
            self.get_logger().info(f"robot {name}: {kind.split('_')[1]} (topics {self.topics.get(name)})")
        elif kind in ROBOT_ERRORS and name in self.figures and not detail.get("whole_batch"):
            fig = self.figures[name]
            fig.errors += 1
            fig.last_error, fig.last_error_at = f"{kind}: {detail.get('error', detail)}", time.monotonic()
            log = self.get_logger().warning if kind == "bad_frame" else self.get_logger().error
            log(f"robot {name}: {fig.last_error}", throttle_duration_sec=1.0)
        elif kind in ROBOT_ERRORS + ("loop_error", "engine_reset", "batch_timing_invalid"):
            self.chunk_errors += 1
            self._set_error(f"{kind}{f' ({name})' if name else ''}: {detail.get('error', detail)}", sticky=False)
            self.get_logger().error(self.last_error, throttle_duration_sec=1.0)

    def _lower_thread_priority(self, nice: int) -> None:
        """On the loop's own thread (the 'started' event): the camera callbacks of this process win a core over
        a running pass, as for the single inference loop (InferenceLoop._lower_thread_priority says why)."""
        if nice and hasattr(os, "setpriority"):
            tid = threading.get_native_id()
            try:
                os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
            except OSError as exc:
                self.get_logger().warning(f"fleet loop priority unchanged: {exc}")

    # ---- figures --------------------------------------------------------------------------------------
    def wait_between_passes(self, timeout_s: float) -> bool:
        """Housekeeping threads (stats file, /diagnostics) call this first: core/fleet_loop says why."""
        loop = self.loop
        return True if loop is None else loop.wait_between_passes(timeout_s)

    def _robot_kv(self, ns: str) -> dict:
        eng = getattr(self.engine, "robots", {}).get(ns) if self.engine is not None else None
        if eng is None:
            return {}
        try:  # read from another thread than the one running passes: a figure may be one pass old
            return dict(eng.kv.stats())
        except Exception as exc:
            return {"error": repr(exc)}

    def robot_snapshot(self, ns: str, loop_stats: Optional[dict] = None) -> dict[str, Any]:
        """One robot's figures: camera, loop counters, scheduler counters, fresh actions, KV, its last error.
        Without ``loop_stats``: from the fleet's snapshot when one is at most ``ROBOT_SNAPSHOT_MAX_AGE_S`` old
        (/diagnostics reads every robot right after the fleet: one loop.stats() per publish, not N + 1)."""
        if loop_stats is None:
            robots = self.snapshot(max_age_s=ROBOT_SNAPSHOT_MAX_AGE_S).get("robots") or {}
            if ns in robots:
                return robots[ns]
            loop_stats = self.loop_stats()
        fig = self.figures[ns]
        now = time.monotonic()
        return {
            "served": ns in (loop_stats.get("robots") or {}),
            "topics": dict(self.topics[ns]),
            "fresh_actions": fig.fresh, "fresh_rate_hz": fig.rate.rate(),
            "frame_to_action_ms": fig.frame_to_action_ms.summary(),
            "loop": (loop_stats.get("robots") or {}).get(ns, {}),
            "scheduler": ((loop_stats.get("scheduler") or {}).get("robots") or {}).get(ns, {}),
            "kv": self._robot_kv(ns),
            "camera": self.cameras[ns].snapshot() if ns in self.cameras else {},
            "errors": fig.errors, "last_error": fig.last_error,
            "last_error_age_s": None if fig.last_error_at is None else now - fig.last_error_at,
        }

    def loop_stats(self) -> dict:
        if self.loop is None:
            return {}
        try:
            return dict(self.loop.stats())
        except Exception as exc:
            return {"error": repr(exc)}

    def snapshot(self, max_age_s: float = 0.0) -> dict[str, Any]:
        """The inference node's keys (the runtime's stats and /diagnostics read them) for the fleet as a whole,
        plus ``robots``: every robot's ``robot_snapshot``. ``max_age_s`` > 0: the last one when it is at most
        that old (read-only for the caller: it is shared)."""
        cached = self._snapshot_cache
        if max_age_s > 0 and cached is not None and time.monotonic() - cached[0] <= max_age_s:
            return cached[1]
        t = time.monotonic()
        snap = self._build_snapshot()
        self._snapshot_cache = (t, snap)
        return snap

    def _build_snapshot(self) -> dict[str, Any]:
        loop = self.loop_stats()
        totals = loop.get("totals") or {}
        vals = self.params.values
        robots = {ns: self.robot_snapshot(ns, loop) for ns in self.robots}
        kvs = [r["kv"] for r in robots.values() if r["kv"] and "error" not in r["kv"]]
        for kv in kvs:
            self.max_occupancy_tokens = max(self.max_occupancy_tokens, int(kv.get("max_occupancy_tokens", 0) or 0))
        pass_ms = loop.get("pass_ms") or {}
        sched = self.scheduler
        fit = {}
        if sched is not None:
            fit = {"estimate_ms": sched.cost_model.estimate_ms(1, sched.decode_steps),
                   "budget_ms": float(vals["deadline_ms"]) - float(vals["safety_margin_ms"])}
            fit["estimate_ms"] = fit["estimate_ms"] or None  # 0.0: nothing measured yet
        return {
            "state": self.current_state_label(), "backend": self.backend,
            "robot_namespaces": list(self.robots),
            "admitted": totals.get("admitted", 0),
            "refused": sum(n for k, n in totals.items() if k.startswith("refused_")),
            "deadline_misses": totals.get("deadline_misses", 0),
            "fresh_actions": self.fresh_count, "fresh_rate_hz": self.fresh_rate.rate(),
            "latency_ms": {k: pass_ms.get(k, math.nan) for k in ("p50", "p95", "p99", "max")},  # one pass
            "frame_to_action_ms": self.frame_to_action_ms.summary(),
            "kv": {"policy": vals["eviction_policy"],
                   "budget_tokens": kvs[0].get("budget_tokens", vals["kv_budget_tokens"]) if kvs
                   else vals["kv_budget_tokens"],
                   "window_frames": vals["window_frames"],
                   "occupancy_tokens": sum(int(kv.get("occupancy_tokens", 0) or 0) for kv in kvs),
                   "max_occupancy_tokens": self.max_occupancy_tokens},  # per robot's cache, the largest
            "engine_memory": self._engine_memory(), "rss_mb": current_rss_mb(),
            "vram_mb": (self._note_memory() or {}).get("current_bytes", 0) / 2**20,  # cuda only (InferenceNode's)
            "peak_vram_mb": self.peak_vram_mb,
            "last_error": self.last_error,
            "last_error_age_s": None if self.last_error_at is None else time.monotonic() - self.last_error_at,
            "last_error_sticky": self.last_error_sticky,
            "deadline_ms": vals["deadline_ms"], "deadline_fit": fit, "action_horizon": self.action_horizon,
            "in_flight_ms": float(loop.get("in_flight_ms", 0.0) or 0.0),
            "loop": loop, "warmup": self.warmup_stats, "transitions": list(self.transitions),
            "robots": robots,
        }
