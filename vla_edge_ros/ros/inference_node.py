"""`vla_inference`: the managed (lifecycle) inference node.

Transitions (``ros2 lifecycle set /vla_inference <transition>``):
- configure: build the engine (engine.factory.make_engine: backend, checkpoint load + validation, kernels,
  KV manager), refuse a checkpoint whose action chunks (vla.action_horizon, vla.chunk_decode) the backend cannot
  decode (``Engine.chunk_support_problem``, named in the failure), set the action executor's horizon (role all)
  and run ``warmup_chunks`` chunks that seed the admission EMAs (not counted in live figures);
- activate: the inference loop (its own thread, never an executor callback) starts admitting chunks;
- deactivate: the loop pauses; the action publisher holds (role all: the arbiter is marked stale;
  robot side of a split: fresh actions stop, so it repeats, then holds after stale_after_ms);
- cleanup / shutdown: the loop stops, ``engine.close()`` frees model and KV memory, references are dropped.
An exception in a transition returns FAILURE (configure/activate) or ERROR, logs the reason and reports it on
/diagnostics (``last_error``); the node stays in a defined lifecycle state (FAILURE: the state it was in;
ERROR: error processing releases everything and leaves it 'unconfigured'). Such an error is "sticky": ERROR on
/diagnostics until the next successful transition. A chunk fault reported by the inference loop is not: ERROR
for diagnostics.ERROR_HOLD_S after the last one, then WARN "recovered; last error: ..." until
diagnostics.RECOVERED_WARN_S, then OK (``last_error_age_s`` says how old it is).

Guard: with the Jazzy wheels (rclpy 7.1) an invalid transition request (e.g. 'activate' while unconfigured)
raises an uncaught RCLError inside the change_state service callback and kills the whole process. The service
callback is wrapped here so the caller gets ``success=False`` instead (Kilted behaves like this natively).

Live parameters are validated by the ParamBridge and applied by the inference loop at the documented point
(next cycle / next eviction / a budget shrink evicts at once).

Each fresh chunk ((H, action_dims), stamped with its frame) goes to the action executor: offered directly in
role all (one step per control period, the action node's), or, in role edge, published on
``fresh_action_topic`` as a JointState carrying the chunk row-major (ros/conversions.py; for H = 1 the
single-action message it always was).
"""
from __future__ import annotations

import gc
import math
import threading
import time
import traceback
from typing import Any, Callable, Optional, Sequence

from rclpy._rclpy_pybind11 import RCLError
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from sensor_msgs.msg import JointState

from vla_edge_ros import params as registry
from vla_edge_ros.core.admission import AdmissionController
from vla_edge_ros.core.double_buffer import DoubleBuffer
from vla_edge_ros.core.metrics import LatencyStats, RateCounter, current_rss_mb
from vla_edge_ros.engine.quant import fit_advice
from vla_edge_ros.ros import conversions, qos
from vla_edge_ros.ros.param_bridge import ParamBridge

INACTIVE_REASON = "inference_inactive"
# live parameters the inference loop applies between chunks (its one queue; the engine's KV settings included)
LOOP_PARAMS = ("deadline_ms", "safety_margin_ms", "ema_alpha", "cost_quantile", "saliency_threshold",
               "kv_budget_tokens", "eviction_policy", "window_frames", "execution_horizon_steps")


class InferenceNode(LifecycleNode):
    NODE_NAME = registry.INFERENCE

    def __init__(self, frame_buffer: DoubleBuffer, arbiter: Any = None, publish_fresh: bool = False,
                 on_action_names: Callable[[Sequence[str]], None] | None = None,
                 action_rate_hz: Callable[[], float] | None = None,
                 chunk_step_hz: Callable[[], float] | None = None, **node_kwargs):
        super().__init__(self.NODE_NAME, **node_kwargs)
        self.params = ParamBridge(self, registry.INFERENCE, on_change=self._on_params,
                                  prefix_tokens=self._prefix_tokens)
        self.buffer = frame_buffer
        self.arbiter = arbiter  # role all: fresh actions are offered directly (shared object, no DDS hop)
        self._on_action_names = on_action_names
        self._action_rate_hz = action_rate_hz
        self._chunk_step_hz = chunk_step_hz
        self.chunk_errors = 0
        self._fresh_pub = None
        if publish_fresh:  # role edge: fresh actions go to the robot process over DDS
            self._fresh_pub = self.create_publisher(JointState, self.params.get("fresh_action_topic"),
                                                    qos.reliable_qos())
        self.engine = None
        self.admission: Optional[AdmissionController] = None
        self.loop = None
        self.action_names: tuple[str, ...] = ()
        self.action_horizon = 1  # the checkpoint's vla.action_horizon, known after configure
        self.last_error = ""
        # When last_error was set (monotonic s) and whether it is a transition failure ("sticky": ERROR on
        # /diagnostics until the next successful transition) or a chunk fault (ERROR for a few seconds, then
        # "recovered"; see diagnostics.inference_health).
        self.last_error_at: Optional[float] = None
        self.last_error_sticky = False
        self.transitions: list[tuple[str, str]] = []  # (transition, result) history, for tests/diagnostics
        self.fresh_rate = RateCounter(1.0)
        self.frame_to_action_ms = LatencyStats(4096)  # camera stamp -> action offered/published
        self.fresh_count = 0
        self.max_occupancy_tokens = 0
        self.occupancy_tokens = 0
        self.peak_vram_mb = 0.0
        self.warmup_stats: Any = None
        self.backend = "none"
        # Transitions come from the change_state service (executor thread) and from code (autostart, shutdown
        # in the main thread): one at a time.
        self._transition_lock = threading.RLock()
        if self.arbiter is not None:
            self.arbiter.mark_inputs_stale(INACTIVE_REASON)
        self._guard_change_state_service()

    # ---- the RCLError guard ---------------------------------------------------------------------------
    def _guard_change_state_service(self) -> None:
        svc = getattr(self, "_service_change_state", None)
        if svc is None:
            return
        original = svc.callback

        def guarded(request, response):
            try:
                with self._transition_lock:
                    return original(request, response)
            except RCLError as exc:
                label = request.transition.label or str(request.transition.id)
                self.get_logger().warning(f"invalid transition '{label}' from state "
                                          f"'{self.current_state_label()}' refused: {exc}")
                self.transitions.append((label, "invalid"))
                response.success = False
                return response

        svc.callback = guarded

    def current_state_label(self) -> str:
        return self._state_machine.current_state[1]

    def safe_transition(self, name: str) -> bool:
        """configure/activate/deactivate/cleanup/shutdown from code (autostart); False when refused or failed."""
        trigger = getattr(self, f"trigger_{name}")
        try:
            with self._transition_lock:
                return trigger() == TransitionCallbackReturn.SUCCESS
        except RCLError as exc:
            self.get_logger().warning(f"transition '{name}' not possible from '{self.current_state_label()}': {exc}")
            self.transitions.append((name, "invalid"))
            return False

    # ---- transitions ----------------------------------------------------------------------------------
    def _set_error(self, text: str, sticky: bool) -> None:
        self.last_error = text
        self.last_error_at = time.monotonic()
        self.last_error_sticky = sticky

    def _succeeded(self, transition: str) -> None:
        # A successful transition ends the condition a failed one reported (chunk faults keep their own clock).
        if self.last_error_sticky:
            self.last_error, self.last_error_at, self.last_error_sticky = "", None, False
        self.transitions.append((transition, "success"))

    def _fail(self, transition: str, exc: BaseException, code=TransitionCallbackReturn.FAILURE):
        self._set_error(f"{transition} failed: {type(exc).__name__}: {exc}", sticky=True)
        self.get_logger().error(self.last_error)
        self.get_logger().debug(traceback.format_exc())
        self.transitions.append((transition, "failure"))
        return code

    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        from vla_edge_ros.core.inference_loop import InferenceLoop
        from vla_edge_ros.engine.factory import make_engine

        t0 = time.monotonic()
        try:
            values = dict(self.params.values)
            self.engine = make_engine(values, self.get_logger().info)
            self.backend = getattr(self.engine, "name", "?")
            support = getattr(self.engine, "chunk_support_problem", None)  # engine/interface.Engine
            problem = support() if support is not None else None
            if problem:
                raise RuntimeError(f"checkpoint refused: {problem}")
            self.action_names = self.engine.action_names
            self.action_horizon = int(getattr(getattr(self.engine, "cfg", None), "action_horizon", 1))
            if self._on_action_names is not None:
                self._on_action_names(self.action_names)
            if self.arbiter is not None:
                self.arbiter.set_horizon(self.action_horizon)
            self.admission = AdmissionController(values["deadline_ms"], values["safety_margin_ms"],
                                                 values["ema_alpha"], cost_quantile=values["cost_quantile"])
            self.loop = InferenceLoop(self.engine, self.buffer, self.admission, self.cycle_period_ms(),
                                      on_action=self._on_action, on_event=self._on_event,
                                      decode_tokens=max(1, int(getattr(self.engine, "decode_steps",  # real steps
                                                                       values["decode_tokens"]))),
                                      saliency_threshold=values["saliency_threshold"],
                                      thread_nice=values["inference_thread_nice"],
                                      action_horizon=self.action_horizon,
                                      execution_horizon_steps=values["execution_horizon_steps"],
                                      force_committed_steps=values["force_committed_steps"],
                                      step_ms=self._set_step_ms())
            self.warmup_stats = self.loop.warmup(values["warmup_chunks"])
            self._note_memory()
        except Exception as exc:
            self._release()
            return self._fail("configure", exc)
        self.last_error, self.last_error_at, self.last_error_sticky = "", None, False  # a new engine: clean slate
        self._succeeded("configure")
        self.get_logger().info(f"configured: backend {self.backend}, warm-up {values['warmup_chunks']} chunks, "
                               f"{time.monotonic() - t0:.1f} s")
        if self.warmup_stats and self.warmup_stats.get("fits") is False:
            # Not a failure (a slow first spell can pass; probes re-measure), but on a GPU too slow for the model
            # every chunk will be refused and the robot will only repeat / hold: say so now, with the figures.
            w = self.warmup_stats
            self.get_logger().warning(
                f"warm-up chunk estimate {w['estimate_ms']:.1f} ms > {w['budget_ms']:.1f} ms (deadline_ms "
                f"{values['deadline_ms']:g} - safety_margin_ms {values['safety_margin_ms']:g}): chunks will be "
                "refused and the robot will repeat / hold; use a faster GPU or a smaller model, "
                f"{fit_advice(values['weight_dtype'])}, fewer decode_tokens, or a longer deadline_ms")
        return TransitionCallbackReturn.SUCCESS

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        try:
            if self.loop is None:
                raise RuntimeError("not configured")
            if self.loop.running:
                self.loop.resume()
            else:
                self.loop.start()
            if self.arbiter is not None:
                self.arbiter.clear_stale(INACTIVE_REASON)
        except Exception as exc:
            return self._fail("activate", exc)
        self._succeeded("activate")
        self.get_logger().info("active: admitting chunks")
        return super().on_activate(state)

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        try:
            if self.arbiter is not None:
                self.arbiter.mark_inputs_stale(INACTIVE_REASON)
            self.loop.pause()
        except Exception as exc:
            return self._fail("deactivate", exc, TransitionCallbackReturn.ERROR)
        self._succeeded("deactivate")
        self.get_logger().info("inactive: inference paused, action publisher holds")
        return super().on_deactivate(state)

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        try:
            self._release()
        except Exception as exc:
            return self._fail("cleanup", exc, TransitionCallbackReturn.ERROR)
        self._succeeded("cleanup")
        self.get_logger().info("cleaned up: engine closed, model and KV memory released")
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        try:
            self._release()
        except Exception as exc:
            return self._fail("shutdown", exc, TransitionCallbackReturn.ERROR)
        self._succeeded("shutdown")
        return TransitionCallbackReturn.SUCCESS

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        # Error processing: release everything; SUCCESS brings the node back to 'unconfigured' (a defined
        # state an operator can configure again), FAILURE would finalize it.
        try:
            self._release()
        except Exception as exc:
            self.last_error += f"; error processing failed: {exc!r}"
            return TransitionCallbackReturn.FAILURE
        return TransitionCallbackReturn.SUCCESS

    def _release(self) -> None:
        if self.arbiter is not None:
            self.arbiter.mark_inputs_stale(INACTIVE_REASON)
        loop, self.loop = self.loop, None
        engine, self.engine = self.engine, None
        self.admission = None
        if loop is not None:
            loop.stop()
        if engine is not None:
            engine.close()
        del loop, engine
        gc.collect()

    def _prefix_tokens(self) -> int:
        """The pinned prefix the budget must hold: the engine's once it exists, else the instruction's bytes."""
        if self.engine is not None:
            return self.engine.prefix_tokens
        return len(self.params.get("instruction").encode("utf-8"))

    # ---- inference-thread callbacks -------------------------------------------------------------------
    def _on_action(self, result: Any, frame: Any = None, *_: Any) -> None:
        now_ns = self.get_clock().now().nanoseconds
        stamp_ns = int(getattr(result, "frame_stamp_ns", 0) or getattr(frame, "stamp_ns", 0) or 0)
        chunk = getattr(result, "chunk", None)
        if chunk is None:  # a bare action (H = 1)
            chunk = getattr(result, "action", result)
        self.fresh_count += 1
        self.fresh_rate.add()
        if stamp_ns:
            self.frame_to_action_ms.add(max(0.0, (now_ns - stamp_ns) / 1e6))
        occ = int(getattr(result, "kv_occupancy_tokens", 0) or 0)
        self.occupancy_tokens = occ
        self.max_occupancy_tokens = max(self.max_occupancy_tokens, occ)
        if self.arbiter is not None:  # role all: steps of the action node's chunk step period
            self.arbiter.offer(chunk, stamp_ns, int(round(self.chunk_step_ms() * 1e6)), now_ns)
        if self._fresh_pub is not None:
            self._fresh_pub.publish(conversions.fresh_chunk_to_msg(chunk, stamp_ns, self.action_names,
                                                                   self.fresh_count))

    def _on_event(self, kind: str, info: Any = None) -> None:
        info = info or {}
        if kind in ("chunk_error", "loop_error"):
            self.chunk_errors += 1
            self._set_error(f"{kind}: {info.get('error', info)}", sticky=False)
            self.get_logger().error(self.last_error, throttle_duration_sec=1.0)
        elif kind == "update_rejected":
            self.get_logger().warning(f"live change not applied: {info}")
        elif kind == "kv_update_failed":
            self._set_error(f"KV change {info.get('values')} failed: {info.get('error')}", sticky=False)
            self.get_logger().error(self.last_error)

    # ---- live parameters ------------------------------------------------------------------------------
    def cycle_period_ms(self) -> float:
        """Control-cycle period of the inference loop: the action publisher's period when it is in this
        process (role all), else the registry default rate (30 Hz)."""
        rate = self._action_rate_hz() if self._action_rate_hz is not None else \
            registry.BY_NAME["action_rate_hz"].default
        return 1000.0 / float(rate)

    def _set_step_ms(self) -> float | None:
        """The loop's ``step_ms``: None (the cycle period, which follows action_rate_hz) unless the action node's
        chunk_step_hz (role all) is set; an edge process has no action node: its steps are its cycles."""
        hz = float(self._chunk_step_hz()) if self._chunk_step_hz is not None else 0.0
        return 1000.0 / hz if hz > 0.0 else None

    def chunk_step_ms(self) -> float:
        """Period of an action chunk's steps (``_set_step_ms``, else the cycle period)."""
        step = self._set_step_ms()
        return self.cycle_period_ms() if step is None else step

    def set_cycle_rate(self, rate_hz: float) -> None:
        if self.loop is not None:
            self.loop.update(period_ms=1000.0 / float(rate_hz))  # steps follow it unless chunk_step_hz is set

    def _on_params(self, changes: dict) -> None:
        loop = self.loop
        loop_changes = {k: v for k, v in changes.items() if k in LOOP_PARAMS}
        if loop is not None and loop_changes:
            # Queued in the loop and applied by the inference thread at its next cycle (the engine is
            # single-threaded); raises ValueError -> the ParamBridge refuses with the reason.
            loop.update(**loop_changes)
        # Unconfigured: the values are stored by the ParamBridge and used at the next configure.

    # ---- figures --------------------------------------------------------------------------------------
    def _note_memory(self) -> dict:
        eng = self.engine
        if eng is None or self.backend != "cuda":
            return {}
        try:
            mem = eng.memory()
        except Exception:
            return {}
        self.peak_vram_mb = max(self.peak_vram_mb, mem.get("peak_bytes", 0) / 2**20)
        return mem

    def _engine_memory(self) -> dict:
        eng = self.engine
        if eng is None:
            return {"current_bytes": 0, "peak_bytes": 0}
        try:
            return dict(eng.memory())
        except Exception as exc:
            return {"error": repr(exc)}

    def snapshot(self) -> dict[str, Any]:
        adm = self.admission.stats() if self.admission is not None else {}
        loop_stats: dict = {}
        if self.loop is not None:
            try:
                loop_stats = dict(self.loop.stats())
            except Exception as exc:
                loop_stats = {"error": repr(exc)}
        mem = self._note_memory()
        chunk = adm.get("chunk_ms", {})
        vals = self.params.values
        kv_stats: dict = {}
        kv = getattr(self.engine, "kv", None) if self.engine is not None else None
        if kv is not None:
            try:  # read from another thread than the one admitting frames: a figure may be one chunk old
                kv_stats = dict(kv.stats())
            except Exception as exc:
                kv_stats = {"error": repr(exc)}
            self.max_occupancy_tokens = max(self.max_occupancy_tokens,
                                            int(kv_stats.get("max_occupancy_tokens", 0) or 0))
        return {
            "state": self.current_state_label(),
            "backend": self.backend,
            "admitted": adm.get("admitted", 0),
            "refused": adm.get("refused", 0),
            "deadline_misses": adm.get("deadline_misses", 0),
            "fresh_actions": self.fresh_count,
            "fresh_rate_hz": self.fresh_rate.rate(),
            "latency_ms": {k: chunk.get(k, math.nan) for k in ("p50", "p95", "p99", "max")},
            "frame_to_action_ms": self.frame_to_action_ms.summary(),
            "kv": {"policy": kv_stats.get("policy", vals["eviction_policy"]),
                   "budget_tokens": kv_stats.get("budget_tokens", vals["kv_budget_tokens"]),
                   "window_frames": kv_stats.get("window_frames", vals["window_frames"]),
                   "occupancy_tokens": kv_stats.get("occupancy_tokens", self.occupancy_tokens),
                   "max_occupancy_tokens": self.max_occupancy_tokens,
                   "evictions": kv_stats.get("evictions", 0),
                   "live_changes_applied": self.loop.kv_changes_applied if self.loop is not None else 0},
            "kv_manager": kv_stats,
            "engine_memory": self._engine_memory(),
            "rss_mb": current_rss_mb(),
            "vram_mb": mem.get("current_bytes", 0) / 2**20 if mem else 0.0,
            "peak_vram_mb": self.peak_vram_mb,
            "last_error": self.last_error,
            "last_error_age_s": None if self.last_error_at is None else time.monotonic() - self.last_error_at,
            "last_error_sticky": self.last_error_sticky,
            "deadline_ms": adm.get("deadline_ms", vals["deadline_ms"]),
            "action_horizon": self.action_horizon,
            "admission": adm,
            "loop": loop_stats,
            "transitions": list(self.transitions),
        }
