"""One inference thread serving a fleet of robots with one batched engine (``--role edge``), free of ROS.

Why one thread and one pass: the weights are read once per forward pass, so the chunks due in the same cycle are
run as one batch (core/fleet_scheduler.py says which). Each robot keeps its own camera DoubleBuffer, KV cache
(inside the engine, by robot name), scheduler admission state and counters; robots meet only in the batch.

Per cycle (a fixed CycleClock grid of ``cycle_period_ms``, as InferenceLoop's):

1. robot joins / leaves queued by ``add_robot`` / ``remove_robot`` (any thread: ROS discovery, parameter
   callbacks) are applied first, so the cycle in progress never loses a member; the engine is not thread-safe,
   so its ``add_robot`` / ``remove_robot`` run here, on the one thread that runs the passes;
2. a robot whose buffer holds an unread frame is ready, with deadline = cycle start + ``deadline_ms``; a frame
   the scheduler refused is retried once next cycle when no newer frame arrived (InferenceLoop's retry);
3. ``scheduler.plan``; each admitted frame is converted when its camera left that to the taker (a frame with a
   ``convert()`` method: ros/fleet_node.py defers JPEG / YUV decoding to here, so the frames no pass takes are
   never decoded) and encoded (a ValueError or ImageRejected: a malformed image, rejected and counted for that
   robot, out of the batch), tagged salient per robot (cosine distance from that robot's previous frame);
4. ONE ``engine.run_batch``; its cost is fed to ``scheduler.record`` in the cost model's three parts: the
   engine's own timing of the pass (``last_batch_timing``: prefill, decode) and the host's part, the rest of the
   time from the scheduler's decision (``plan.now_ns``) to the results (conversion, encode, the engine's host
   work, waiting for a core or the GIL), so that the next decision's estimate covers all of it;
5. per robot, as InferenceLoop per chunk: past the deadline it is a deadline miss; more than ``late_discard_ms``
   (default one period) past it the action is discarded, else ``on_action(name, result)``. An Exception in the
   result for one robot is that robot's error only; run_batch raising is an error for every member. The engine
   is reset when it says its state is bad (``needs_reset``, or a MemoryError); the loop goes on.

Engine contract: core/fleet_contract.py (``FleetEngine``, ``BatchRequest``).

Events: ``on_event(name, kind, detail)``, name None for fleet-wide ones. ``stats()`` is JSON-able (json.dumps).
Percentiles in ``stats()`` (``latency_ms``, ``pass_ms``, ``host_ms``) are of the last ``history`` samples; the
``*_hist`` entries are cumulative histograms (core/metrics.py ``CumulativeHistogram``) from which a window's
percentiles are computed exactly to a bucket (``window_percentiles``: bench/fleet_replay.py's measured window).
"""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from vla_edge_ros import params
from vla_edge_ros.core.admission import CycleClock
from vla_edge_ros.core.cycle_runner import CycleRunner
from vla_edge_ros.core.double_buffer import DoubleBuffer
from vla_edge_ros.core.fleet_contract import BatchRequest, FleetEngine  # noqa: F401  (re-exported)
from vla_edge_ros.core.fleet_scheduler import BAD_DEADLINE, CAPACITY, DEADLINE, UNKNOWN, BatchPlan, FleetScheduler
from vla_edge_ros.core.fleet_warmup import WARMUP_PREFIX, warm_up
from vla_edge_ros.core.image_convert import ImageRejected
from vla_edge_ros.core.inference_loop import cosine_distance
from vla_edge_ros.core.loop_settings import check_loop_values
from vla_edge_ros.core.metrics import CumulativeHistogram, LatencyStats
from vla_edge_ros.core.pass_profile import PassProfile

DELIVERED, LATE, ERROR, BAD_FRAME, REFUSED = "delivered", "late_discarded", "error", "bad_frame", "refused"
COUNTERS = ("frames_taken", "admitted", "frames_run", "actions_delivered", "deadline_misses", "late_discarded",
            "errors", "bad_frames", "retried", "dropped_while_paused", "salient_frames", "callback_errors",
            *(f"refused_{reason}" for reason in (DEADLINE, CAPACITY, BAD_DEADLINE, UNKNOWN)))


@dataclass
class CycleOutcome:
    now_ns: int
    plan: Optional[BatchPlan] = None  # None: paused
    ran: tuple[str, ...] = ()  # the members of the pass (admitted minus bad frames)
    outcomes: dict[str, str] = field(default_factory=dict)  # ready robot -> DELIVERED / LATE / ERROR / ...
    missed: tuple[str, ...] = ()  # members that finished past their deadline


class _Robot:
    def __init__(self, name: str, buffer: DoubleBuffer, history: int) -> None:
        self.name, self.buffer = name, buffer
        self.retry: Any = None  # a refused frame, retried once next cycle unless a newer one arrives
        self.prev_pooled: Optional[np.ndarray] = None
        self.resume_written = 0  # buffer seq at resume(): frames at or below it were written while paused
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.latency = LatencyStats(history)  # conversion + encode + pass of the batches it was in, ms
        self.latency_hist = CumulativeHistogram()  # the same samples, since start
        self.last_error = ""

    def stats(self) -> dict:
        return {**self.counts, "latency_ms": self.latency.summary(), "latency_hist": self.latency_hist.snapshot(),
                "last_error": self.last_error, "frames": self.buffer.stats()}


class FleetLoop:
    def __init__(self, engine: FleetEngine, scheduler: FleetScheduler, cycle_period_ms: float, deadline_ms: float,
                 on_action: Callable[[str, Any], None],
                 on_event: Optional[Callable[[Optional[str], str, dict], None]] = None, *,
                 saliency_threshold: float = 0.2, late_discard_ms: Optional[float] = None,
                 clock_ns: Callable[[], int] = time.monotonic_ns, wait_timeout_s: float = 0.1,
                 history: int = 4096, thread_name: str = "vla_fleet_loop") -> None:
        """``late_discard_ms``: a result finishing more than this past its deadline is discarded (default: one
        period). ``clock_ns``: monotonic clock (injectable: tests drive ``run_cycle`` without a thread)."""
        check_loop_values({"period_ms": cycle_period_ms, "saliency_threshold": saliency_threshold,
                           **({} if late_discard_ms is None else {"late_discard_ms": late_discard_ms})})
        reason = params.validate("deadline_ms", deadline_ms)
        if reason:
            raise ValueError(reason)
        steps = getattr(engine, "decode_steps", None)
        if steps != scheduler.decode_steps:
            raise ValueError(f"engine.decode_steps ({steps!r}) must equal the scheduler's decode_steps "
                             f"({scheduler.decode_steps}): the cost model is per decode step")
        self.engine, self.scheduler = engine, scheduler
        self.on_action, self.on_event = on_action, on_event
        self.deadline_ms = float(deadline_ms)
        self.saliency_threshold = float(saliency_threshold)
        self.late_discard_ms = None if late_discard_ms is None else float(late_discard_ms)
        self._clock_ns = clock_ns
        self._history = history
        self.clock = CycleClock(cycle_period_ms, start_ns=clock_ns())
        self._lock = threading.Lock()  # guards _robots (replaced, not mutated), _pending, _members
        self._robots: dict[str, _Robot] = {}
        self._pending: list[tuple[str, str, Optional[DoubleBuffer]]] = []  # ("add"|"remove", name, buffer)
        self._members: set[str] = set()  # names as they will be once _pending is applied
        self.runner = CycleRunner(self.clock, self.run_cycle, while_paused=self.apply_pending_membership,
                                  on_error=self._loop_error, on_event=lambda kind: self._emit(None, kind, {}),
                                  clock_ns=clock_ns, wait_timeout_s=wait_timeout_s, thread_name=thread_name)
        self._in_flight_since: Optional[int] = None
        self.totals = dict.fromkeys(COUNTERS, 0)  # every robot ever served, those that left included
        self.batch_sizes: dict[int, int] = {}
        self.pass_ms = LatencyStats(history)  # first conversion / encode to results, ms
        self.pass_hist = CumulativeHistogram()
        self.host_ms = LatencyStats(history)  # decision to results minus the engine's pass (the cost model's host)
        self.host_hist = CumulativeHistogram()
        self.profile = PassProfile(clock_ns=clock_ns)  # each pass's stages, wall and CPU: what the host tail waited for
        self.fleet = dict.fromkeys(("cycles", "cycles_paused", "cycle_overruns", "batches", "batch_failures",
                                    "engine_resets", "unexpected_results", "timing_invalid", "loop_errors",
                                    "callback_errors", "robots_added", "robots_removed", "robot_add_failures",
                                    "robot_remove_failures"), 0)
        self.last_batch_timing: dict = {}
        self.last_error = ""
        self.warmup_figures: dict[str, Any] = {}

    # ---- events and counters ------------------------------------------------------------------------------
    def _emit(self, name: Optional[str], kind: str, detail: dict) -> None:
        if self.on_event is None:
            return
        try:
            self.on_event(name, kind, detail)
        except Exception:  # a faulty reporting callback must not stop the fleet
            self.fleet["callback_errors"] += 1

    def _count(self, robot: _Robot, key: str, n: int = 1) -> None:
        robot.counts[key] = robot.counts.get(key, 0) + n
        self.totals[key] = self.totals.get(key, 0) + n

    # ---- membership (any thread; applied by the loop between cycles) ----------------------------------------
    def add_robot(self, name: str, buffer: DoubleBuffer) -> None:
        if not isinstance(name, str) or not name or name.startswith(WARMUP_PREFIX):
            raise ValueError(f"robot name must be a non-empty string not starting with {WARMUP_PREFIX!r}, "
                             f"got {name!r}")
        if not callable(getattr(buffer, "read_latest_with_seq", None)):
            raise ValueError(f"robot {name!r}: buffer must be a DoubleBuffer, got {type(buffer).__name__}")
        with self._lock:
            if name in self._members:
                raise ValueError(f"robot {name!r} is already served")
            self._members.add(name)
            self._pending.append(("add", name, buffer))

    def remove_robot(self, name: str) -> None:
        with self._lock:
            if name not in self._members:
                raise ValueError(f"robot {name!r} is not served")
            self._members.discard(name)
            self._pending.append(("remove", name, None))

    @property
    def robots(self) -> tuple[str, ...]:
        return tuple(self._robots)

    def apply_pending_membership(self) -> None:
        """Apply queued joins / leaves in order (the loop's thread, at the start of each cycle)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for op, name, buffer in pending:
            robots = dict(self._robots)
            if op == "add":
                try:
                    self.engine.add_robot(name)
                    try:
                        self.scheduler.join(name)
                    except Exception:
                        self.engine.remove_robot(name)  # no half-joined robot holding a KV cache
                        raise
                except Exception as exc:  # e.g. no memory left for its KV cache: refused, counted, reported
                    self.fleet["robot_add_failures"] += 1
                    with self._lock:
                        self._members.discard(name)
                    self._emit(name, "robot_add_failed", {"error": f"{type(exc).__name__}: {exc}"})
                    continue
                robots[name] = _Robot(name, buffer, self._history)
                if self.paused:
                    robots[name].resume_written = buffer.written
                self.fleet["robots_added"] += 1
            else:
                if robots.pop(name, None) is None:
                    continue  # its add failed when applied: nothing to remove
                self.fleet["robots_removed"] += 1
                try:
                    self.scheduler.leave(name)
                    self.engine.remove_robot(name)
                except Exception as exc:  # it is gone from the loop either way; the engine's leak is reported
                    self.fleet["robot_remove_failures"] += 1
                    self._emit(name, "robot_remove_failed", {"error": f"{type(exc).__name__}: {exc}"})
            with self._lock:
                self._robots = robots
            self._emit(name, "robot_added" if op == "add" else "robot_removed", {})

    # ---- one cycle ----------------------------------------------------------------------------------------
    def _take_frame(self, robot: _Robot) -> tuple[Any, bool]:
        """(frame, is_retry): the freshest unread frame, else last cycle's refused frame (once), else None."""
        got = robot.buffer.read_latest_with_seq()
        if got is not None and got[0] <= robot.resume_written:  # written before resume(): stale
            self._count(robot, "dropped_while_paused")
        elif got is not None:
            self._count(robot, "frames_taken")
            robot.retry = None
            return got[1], False
        frame, robot.retry = robot.retry, None
        self._count(robot, "retried", int(frame is not None))
        return frame, frame is not None

    def _salient(self, robot: _Robot, tokens: np.ndarray) -> bool:
        pooled = np.asarray(tokens, dtype=np.float32).reshape(len(tokens), -1).mean(axis=0)
        prev, robot.prev_pooled = robot.prev_pooled, pooled
        if prev is None or prev.shape != pooled.shape:
            return True  # its first frame (or after a reset): a new scene for its cache
        return cosine_distance(pooled, prev) > self.saliency_threshold

    def run_cycle(self, now_ns: Optional[int] = None) -> CycleOutcome:
        """Serve one cycle at ``now_ns`` (default: the clock); the thread calls this once per cycle."""
        self.apply_pending_membership()
        now = self._clock_ns() if now_ns is None else int(now_ns)
        if self.paused:
            self.fleet["cycles_paused"] += 1
            return CycleOutcome(now)
        self.fleet["cycles"] += 1
        robots = self._robots
        cycle_start = self.clock.cycle_start(now)
        deadline = cycle_start + int(round(self.deadline_ms * 1e6))
        taken = {name: self._take_frame(robot) for name, robot in robots.items()}
        frames = {name: frame for name, (frame, _) in taken.items() if frame is not None}
        retried = {name for name, (_, is_retry) in taken.items() if is_retry}
        plan = self.scheduler.plan(now, {name: deadline for name in frames})
        out = CycleOutcome(now, plan)
        for name, reason in plan.refused.items():
            robot = robots[name]
            self._count(robot, f"refused_{reason}")  # by the scheduler's reason
            robot.retry = None if name in retried else frames[name]
            out.outcomes[name] = f"{REFUSED}:{reason}"
        if plan.batch:
            self.profile.begin(cycle_start, now)
            self._run_batch(plan, robots, frames, deadline, out, now)
        if self._clock_ns() > cycle_start + int(round(self.clock.period_ms * 1e6)):
            self.fleet["cycle_overruns"] += 1
        return out

    @staticmethod
    def _image(frame: Any, frame_id: Any) -> Any:
        """The frame's pixels: ``convert()`` when its camera deferred the conversion (ImageRejected when they are
        malformed; the camera counts that rejection), else its ``image``."""
        convert = getattr(frame, "convert", None)
        image = convert() if callable(convert) else getattr(frame, "image", None)
        if image is None:
            raise ValueError(f"frame {frame_id!r} has no image")
        return image

    def _run_batch(self, plan: BatchPlan, robots: dict, frames: dict, deadline: int, out: CycleOutcome,
                   decided_ns: int) -> None:
        t0 = self._in_flight_since = self._clock_ns()
        self.profile.mark("plan")
        requests: dict[str, BatchRequest] = {}
        for name in plan.batch:
            robot, frame = robots[name], frames[name]
            self._count(robot, "admitted")
            frame_id = getattr(frame, "frame_id", None)
            try:
                tokens = self.engine.encode_frame(self._image(frame, frame_id))
                salient = self._salient(robot, tokens)
            except Exception as exc:  # its frame is out of the batch; the others run
                # a malformed image: rejected, not an engine failure
                bad = isinstance(exc, (ValueError, ImageRejected))
                self._robot_error(robot, exc, frame_id, False, False, *(("bad_frames", "bad_frame") if bad else ()))
                out.outcomes[name] = BAD_FRAME if bad else ERROR
                continue
            requests[name] = BatchRequest(tokens, frame_id, salient)
            self._count(robot, "salient_frames", int(salient))
        out.ran = tuple(requests)
        self.profile.mark("encode")
        if not requests:
            self._in_flight_since = None
            self.profile.discard()
            return
        for name in requests:
            self._count(robots[name], "frames_run")
        failed_pass: Optional[Exception] = None
        try:
            results = self.engine.run_batch(dict(requests))
            if not isinstance(results, Mapping):
                raise TypeError(f"run_batch must return a mapping name -> result, got {type(results).__name__}")
        except Exception as exc:  # the whole pass failed: an error for every member, the loop goes on
            results, failed_pass = {name: exc for name in requests}, exc
        end = self._clock_ns()
        self.profile.mark("engine")
        self._in_flight_since = None
        if failed_pass is None:
            self._record_pass(len(requests), (end - t0) / 1e6, (end - decided_ns) / 1e6)
        else:
            self.fleet["batch_failures"] += 1
            self.last_error = f"{type(failed_pass).__name__}: {failed_pass}"
        late = end > deadline  # the members share this cycle's deadline
        out.missed = tuple(requests) if late else ()
        failures = []
        for name, req in requests.items():
            robot, result = robots[name], results.get(name)
            if result is not None and not isinstance(result, BaseException) \
                    and getattr(result, "frame_id", req.frame_id) != req.frame_id:  # never another robot's action
                result = RuntimeError(f"result for frame {result.frame_id!r}, expected {req.frame_id!r}")
            if result is None or isinstance(result, BaseException):
                exc = result if result is not None else RuntimeError("run_batch returned no result for it")
                failures.append(exc)
                self._robot_error(robot, exc, req.frame_id, late, failed_pass is not None)
                out.outcomes[name] = ERROR
            else:
                out.outcomes[name] = self._deliver(robot, result, frames[name], req, (end - t0) / 1e6,
                                                   (end - deadline) / 1e6)
        unexpected = [k for k in results if k not in requests]
        if unexpected:
            self.fleet["unexpected_results"] += len(unexpected)
            self._emit(None, "unexpected_results", {"names": [repr(k)[:64] for k in unexpected[:8]]})
        if failures:
            self._maybe_reset(failures)
        self.profile.mark("deliver")
        if failed_pass is None:
            timing = getattr(self.engine, "last_batch_timing", None)
            self.profile.end(len(requests), self.last_batch_timing.get("host_ms", 0.0),
                             timing if isinstance(timing, Mapping) else None)
        else:  # counted as a batch failure: no host part was learned
            self.profile.discard()

    def _engine_timing(self, total_ms: float) -> tuple[float, float]:
        """(prefill, decode) ms of the last pass as the engine timed it, within ``total_ms``; (0, 0) when its
        timing is missing or malformed (counted and reported: the whole time is then learned as host)."""
        timing = getattr(self.engine, "last_batch_timing", None)
        try:
            got = {k: float(timing[k]) for k in ("prefill_ms", "decode_ms")}
            if not all(math.isfinite(v) and v >= 0.0 for v in got.values()):
                raise ValueError("not finite and non-negative")
        except Exception as exc:
            self.fleet["timing_invalid"] += 1
            self._emit(None, "batch_timing_invalid", {"timing": repr(timing)[:200], "error": str(exc)})
            return 0.0, 0.0
        decode_ms = min(got["decode_ms"], total_ms)
        return min(got["prefill_ms"], total_ms - decode_ms), decode_ms

    def _record_pass(self, size: int, wall_ms: float, total_ms: float) -> None:
        """``wall_ms``: first conversion / encode to results; ``total_ms``: the scheduler's decision to results."""
        self.fleet["batches"] += 1
        self.batch_sizes[size] = self.batch_sizes.get(size, 0) + 1
        self.pass_ms.add(wall_ms)
        self.pass_hist.add(wall_ms)
        prefill_ms, decode_ms = self._engine_timing(total_ms)
        self.last_batch_timing = {"prefill_ms": prefill_ms, "decode_ms": decode_ms}
        host_ms = max(0.0, total_ms - prefill_ms - decode_ms)
        self.last_batch_timing["host_ms"] = host_ms
        self.host_ms.add(host_ms)
        self.host_hist.add(host_ms)
        self.scheduler.record(size, prefill_ms, decode_ms, self.engine.decode_steps, host_ms)

    def _deliver(self, robot: _Robot, result: Any, frame: Any, req: BatchRequest, chunk_ms: float,
                 late_ms: float) -> str:
        """InferenceLoop.step's handling of a finished chunk, for one member of the pass."""
        robot.latency.add(chunk_ms)
        robot.latency_hist.add(chunk_ms)
        if late_ms > 0.0:
            self._count(robot, "deadline_misses")
            self._emit(robot.name, "deadline_miss", {"frame_id": req.frame_id, "chunk_ms": chunk_ms,
                                                     "late_ms": late_ms})
        discard_after = self.late_discard_ms if self.late_discard_ms is not None else self.clock.period_ms
        if late_ms > discard_after:  # an action from a frame that old must not be published as fresh
            self._count(robot, "late_discarded")
            self._emit(robot.name, "chunk_late_discarded", {"frame_id": req.frame_id, "late_ms": late_ms})
            return LATE
        try:
            result.salient, result.frame_stamp_ns = req.salient, int(getattr(frame, "stamp_ns", 0) or 0)
        except AttributeError:  # a result type without these fields (the executor then times from receipt)
            pass
        try:
            self.on_action(robot.name, result)
        except Exception as exc:
            self._count(robot, "callback_errors")
            self._emit(robot.name, "action_callback_error", {"frame_id": req.frame_id, "error": repr(exc)})
            return ERROR
        self._count(robot, "actions_delivered")
        return DELIVERED

    def _robot_error(self, robot: _Robot, exc: BaseException, frame_id: Any, missed: bool, batch: bool,
                     counter: str = "errors", kind: str = "chunk_error") -> None:
        self._count(robot, counter)
        robot.last_error = f"{type(exc).__name__}: {exc}"
        if missed:
            self._count(robot, "deadline_misses")
        self._emit(robot.name, kind, {"frame_id": frame_id, "error": robot.last_error, "type": type(exc).__name__,
                                      "whole_batch": batch, "missed_deadline": missed})

    def _maybe_reset(self, excs: list) -> None:
        flag = getattr(self.engine, "needs_reset", False)
        try:
            flag = flag() if callable(flag) else flag
        except Exception:
            flag = True  # cannot even ask: assume the worst
        if not (flag or any(isinstance(e, MemoryError) for e in excs)):
            return
        info: dict[str, Any] = {"after": f"{type(excs[0]).__name__}: {excs[0]}"}
        try:
            self.engine.reset()
            self.fleet["engine_resets"] += 1
        except Exception as exc:
            info["reset_error"] = f"{type(exc).__name__}: {exc}"
        for robot in self._robots.values():
            robot.prev_pooled = None  # every robot's cache was dropped: its next frame is a new scene
        self._emit(None, "engine_reset", info)

    def in_flight_ms(self, now_ns: Optional[int] = None) -> float:
        """How long the current pass has been running (0.0 when none): a watchdog input for a hung batch."""
        since = self._in_flight_since
        return 0.0 if since is None else ((self._clock_ns() if now_ns is None else now_ns) - since) / 1e6

    # ---- warm-up ------------------------------------------------------------------------------------------
    def warmup(self, n: int = 3, image_shape: tuple[int, int, int] = (480, 640, 3)) -> dict[str, Any]:
        """Every batch size measured before ``start`` (core/fleet_warmup.py says how and why)."""
        if n < 0:
            raise ValueError(f"warmup batch count must be >= 0, got {n}")
        if self.running:
            raise RuntimeError("warmup() must run before start(): the engine belongs to one thread")
        self.warmup_figures = warm_up(self.engine, self.scheduler, n, image_shape, self._clock_ns,
                                      self._engine_timing, self._emit)
        self._emit(None, "warmup_done", dict(self.warmup_figures))
        return self.warmup_figures

    # ---- thread (core/cycle_runner.py) ---------------------------------------------------------------------
    def _loop_error(self, exc: Exception) -> None:
        self.fleet["loop_errors"] += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        self._emit(None, "loop_error", {"error": self.last_error, "type": type(exc).__name__})

    def wait_between_passes(self, timeout_s: float, min_gap_ms: float = 8.0) -> bool:
        """For the process's other Python threads' housekeeping (stats files, /diagnostics): CycleRunner's."""
        return self.runner.wait_between_passes(timeout_s, min_gap_ms)

    def start(self) -> None:
        self.runner.start()  # RuntimeError when already running

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop and join; False when the thread is still inside a (hung) pass after ``timeout_s``."""
        return self.runner.stop(timeout_s)

    @property
    def running(self) -> bool:
        return self.runner.running

    @property
    def thread_cpu_s(self) -> float:
        return self.runner.thread_cpu_s

    def pause(self) -> None:
        """Stop running passes (the pass in flight, if any, completes)."""
        self.runner.pause()
        self._emit(None, "paused", {})

    def resume(self) -> None:
        """Resume; frames written while paused are dropped (counted per robot), retries forgotten."""
        for robot in self._robots.values():
            robot.resume_written, robot.retry = robot.buffer.written, None
        self.runner.resume()
        self._emit(None, "resumed", {})

    @property
    def paused(self) -> bool:
        return self.runner.paused

    # ---- figures ------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        with self._lock:
            pending = [f"{op} {name}" for op, name, _ in self._pending]
        robots = self._robots
        return {
            "running": self.running, "paused": self.paused, **self.fleet,
            "period_ms": self.clock.period_ms, "deadline_ms": self.deadline_ms,
            "batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())},
            "pass_ms": self.pass_ms.summary(), "pass_hist": self.pass_hist.snapshot(),
            "host_ms": self.host_ms.summary(), "host_hist": self.host_hist.snapshot(),
            "pass_profile": self.profile.snapshot(),
            "thread_cpu_s": self.thread_cpu_s, "last_batch_timing": dict(self.last_batch_timing),
            "in_flight_ms": self.in_flight_ms(), "last_error": self.last_error, "pending_membership": pending,
            "totals": dict(self.totals),
            "robots": {name: r.stats() for name, r in robots.items()},
            "scheduler": self.scheduler.stats(), "warmup": dict(self.warmup_figures),
        }
