"""The inference thread body, free of ROS: the lifecycle node only constructs, starts, pauses and reads it.

At most one chunk per control cycle. Cycles sit on a fixed grid (``CycleClock``, period ``period_ms``, the
control period); a chunk holds ``action_horizon`` H actions, one per period. When and by when a chunk runs is
``ChunkSchedule``'s (core/chunk_schedule.py): with H = 1 every cycle, deadline = cycle start + ``deadline_ms``;
with H > 1 the next chunk starts once the executing one has played ``execution_horizon_steps`` steps and, when
they overlap, must be in before the executing one (on schedule) runs out. Per cycle:

1. live parameter changes queued by ``update`` are applied (so a change never lands mid-chunk): admission
   settings, loop settings and the engine's KV settings (``engine.apply_kv_changes``) go through this one
   queue, validated once in ``update`` and applied by the one thread that runs the chunks;
2. a cycle in which no chunk is due (the executing chunk has not played its execution horizon) is skipped;
   otherwise the thread waits (only itself; the camera never waits) for an unread frame in the double buffer;
3. the admission controller compares the estimated chunk time with the time left to this cycle's deadline
   minus the safety margin; a refusal is a fallback (the action publisher repeats / holds) and the cycle is over;
4. admitted: encode the frame, tag it salient when its pooled embedding's cosine distance from the previous
   frame exceeds ``saliency_threshold``, ``engine.run_chunk``, record the real duration (encode counts as
   prefill: everything that is not decode) and whether it missed the deadline, then ``on_action(result, frame)``
   with ``result.frame_stamp_ns`` set to the frame's stamp (the executor times the chunk's steps by it). With
   ``force_committed_steps`` and H > 1 the chunk is decoded with the steps the executing chunk commits before it
   arrives forced as its first steps (core/committed_prefix.py; counted in ``stats()["committed_prefix"]``);
5. the thread sleeps to the next cycle boundary, then takes the freshest frame (older unread frames are counted
   as overwritten by the buffer); when none arrived and the previous frame was refused for lack of time, that
   frame is retried once, now with a whole cycle ahead of it.

Faults: an exception in a chunk is caught, counted and reported with ``on_event('chunk_error', {...})``; the
engine is reset when it says its state is bad (``engine.needs_reset`` attribute or method, or a MemoryError);
the loop carries on with the next frame. Python cannot pre-empt a hung chunk: when it finally returns it is
counted as a deadline miss, and when it is more than ``late_discard_ms`` past its deadline its action is
discarded (an action computed from a frame that old must not be published as fresh). ``in_flight_ms`` lets a
watchdog (the node's diagnostics timer) see a chunk that is hung right now.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Optional

import numpy as np

from vla_edge_ros import params
from vla_edge_ros.core.admission import AdmissionController, CycleClock
from vla_edge_ros.core.chunk_schedule import ChunkSchedule
from vla_edge_ros.core.committed_prefix import CommittedPrefix
from vla_edge_ros.core.cycle_runner import LoopThreadState
from vla_edge_ros.core.double_buffer import DoubleBuffer
from vla_edge_ros.core.loop_settings import ADMISSION_KEYS, KV_KEYS, LIVE_KEYS, check_live_values, check_loop_values
from vla_edge_ros.core.metrics import LatencyStats

# outcomes of one step
ADMITTED, REFUSED, ERROR, LATE = "admitted", "refused", "error", "late_discarded"

__all__ = ["ADMITTED", "REFUSED", "ERROR", "LATE", "LIVE_KEYS", "InferenceLoop", "cosine_distance"]
COUNTERS = ("frames_taken", "admitted", "refused", "probes", "completed", "errors", "deadline_misses", "late_discarded",
            "engine_resets", "salient_frames", "dropped_while_paused", "retried", "cycles_not_due", "callback_errors",
            "kv_changes_applied")  # InferenceLoop's counters, in stats() under these names


def cosine_distance(a: np.ndarray, b: np.ndarray) -> float:
    """1 - cos(a, b) in [0, 2]; a zero vector is at distance 0 from another zero vector and 1 from anything else."""
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0.0 or nb == 0.0:
        return 0.0 if na == nb else 1.0
    return float(1.0 - np.dot(a, b) / (na * nb))


class InferenceLoop(LoopThreadState):
    def __init__(self, engine: Any, frame_buffer: DoubleBuffer, admission: AdmissionController, period_ms: float,
                 on_action: Callable[[Any, Any], None], on_event: Optional[Callable[[str, dict], None]] = None, *,
                 decode_tokens: int = 8, saliency_threshold: float = 0.2, late_discard_ms: Optional[float] = None,
                 wait_timeout_s: float = 0.1, time_ns: Callable[[], int] = time.monotonic_ns,
                 thread_name: str = "vla_inference_loop", thread_nice: int = 0, action_horizon: int = 1,
                 execution_horizon_steps: int = 0, force_committed_steps: bool = False,
                 step_ms: Optional[float] = None) -> None:
        """``late_discard_ms``: a chunk finishing more than this past its deadline has its action discarded
        (default: one period). ``time_ns``: monotonic clock (injectable for tests). ``thread_nice``: nice
        increment applied to the loop's own thread (see :meth:`_lower_thread_priority`). ``action_horizon``,
        ``execution_horizon_steps``: the chunk schedule (core/chunk_schedule.py). ``force_committed_steps``:
        force-decode the committed prefix (core/committed_prefix.py). ``step_ms``: the period of a chunk's
        steps (the policy's control period) when it differs from the cycle period (None: the cycle period)."""
        if decode_tokens < 1:
            raise ValueError(f"decode_tokens must be >= 1, got {decode_tokens}")
        if not 0 <= int(thread_nice) <= 19:
            raise ValueError(f"thread_nice must be in [0, 19], got {thread_nice}")
        self.thread_nice = int(thread_nice)
        self.thread_nice_applied: Optional[int] = None
        self.engine = engine
        self.buffer = frame_buffer
        self.admission = admission
        self.on_action = on_action
        self.on_event = on_event
        self.decode_tokens = int(decode_tokens)
        self._time_ns = time_ns
        self.wait_timeout_s = float(wait_timeout_s)
        self.thread_name = thread_name
        check_loop_values({"period_ms": period_ms, "saliency_threshold": saliency_threshold,
                           "force_committed_steps": force_committed_steps,
                           **({} if step_ms is None else {"step_ms": step_ms}),
                           **({} if late_discard_ms is None else {"late_discard_ms": late_discard_ms})})
        self.clock = CycleClock(period_ms, start_ns=time_ns())
        self.schedule = ChunkSchedule(action_horizon, execution_horizon_steps)
        self._executing_start_ns: Optional[int] = None  # cycle start of the last chunk delivered (executing)
        self._executing_stamp_ns: Optional[int] = None  # and its frame's stamp (None: unstamped)
        self.committed = CommittedPrefix(force_committed_steps, action_horizon)  # that chunk's bins, the counts
        self.saliency_threshold = float(saliency_threshold)
        self.late_discard_ms = None if late_discard_ms is None else float(late_discard_ms)
        self.step_ms = None if step_ms is None else float(step_ms)

        self._lock = threading.Lock()  # guards _pending (update() runs on a parameter-callback thread)
        self._pending: dict[str, Any] = {}
        self._init_loop_thread_state()
        self._served_cycle: Optional[int] = None
        self._prev_pooled: Optional[np.ndarray] = None
        self._in_flight_since: Optional[int] = None
        self._resume_written = 0

        # the counters (COUNTERS: reported by stats() under their names)
        self.frames_taken = self.admitted = self.refused = self.probes = self.completed = self.errors = 0
        self.deadline_misses = self.late_discarded = self.engine_resets = self.salient_frames = 0
        self.dropped_while_paused = self.callback_errors = self.kv_changes_applied = 0
        self.retried = 0  # refused-for-time frames retried at the next cycle's start
        self.cycles_not_due = 0  # cycles skipped: the executing chunk had not played its execution horizon
        self.kv_last_evicted: list = []
        self.last_error = ""
        self.last_outcome = ""
        self.chunk_ms = LatencyStats()  # real duration of admitted chunks (encode + run_chunk), ms
        self.warmup_figures: dict[str, Any] = {}

    # ---- events -----------------------------------------------------------------------------------------
    def _emit(self, kind: str, info: dict) -> None:
        if self.on_event is None:
            return
        try:
            self.on_event(kind, info)
        except Exception:  # a faulty reporting callback must not stop inference
            self.callback_errors += 1

    # ---- live parameters --------------------------------------------------------------------------------
    def update(self, **values: Any) -> None:
        """Validate now (ValueError with reasons), apply at the start of the next cycle. Keys: ``LIVE_KEYS``."""
        check_live_values(values, self.schedule.horizon)  # core/loop_settings.py
        with self._lock:
            merged = {"deadline_ms": self.admission.deadline_ms, "safety_margin_ms": self.admission.safety_margin_ms,
                      **{k: v for k, v in self._pending.items() if k in ADMISSION_KEYS}, **values}
            combo = {"deadline_ms": float(merged["deadline_ms"]), "safety_margin_ms": float(merged["safety_margin_ms"])}
            kv = getattr(self.engine, "kv", None)
            if "kv_budget_tokens" in values and kv is not None:
                combo.update(kv_budget_tokens=values["kv_budget_tokens"], tokens_per_frame=kv.tokens_per_frame)
            reasons = params.validate_combination(combo, getattr(self.engine, "prefix_tokens", 0) if kv else 0)
            if reasons:
                raise ValueError("; ".join(reasons))
            self._pending.update(values)

    def apply_pending_updates(self) -> None:
        """Apply queued ``update`` values (the loop calls this at the start of every cycle)."""
        with self._lock:
            pending, self._pending = self._pending, {}
        if not pending:
            return
        adm = {k: v for k, v in pending.items() if k in ADMISSION_KEYS}
        try:
            self.admission.update(**adm)
        except ValueError as exc:  # validated in update(); only a concurrent direct admission change gets here
            self._emit("update_rejected", {"values": adm, "reason": str(exc)})
        kv = {k: v for k, v in pending.items() if k in KV_KEYS}
        if kv:
            try:
                self.kv_last_evicted = self.engine.apply_kv_changes(kv)
                self.kv_changes_applied += 1
            except Exception as exc:  # the engine refused (e.g. a budget its device buffers cannot hold)
                self._emit("kv_update_failed", {"values": kv, "error": f"{type(exc).__name__}: {exc}"})
        if "saliency_threshold" in pending:
            self.saliency_threshold = float(pending["saliency_threshold"])
        if "late_discard_ms" in pending:
            self.late_discard_ms = float(pending["late_discard_ms"])
        if "execution_horizon_steps" in pending:
            self.schedule.set_execution_horizon(pending["execution_horizon_steps"])
        if "step_ms" in pending:
            self.step_ms = float(pending["step_ms"])
        if "period_ms" in pending:
            self.clock.set_period_ms(float(pending["period_ms"]), start_ns=self._time_ns())
            self._served_cycle = None
        self._emit("params_applied", dict(pending))

    # ---- warm-up ----------------------------------------------------------------------------------------
    def warmup(self, n: int, image_shape: tuple[int, int, int] = (480, 640, 3)) -> dict[str, Any]:
        """Run ``n`` chunks on a seeded synthetic image outside the control loop, seed the admission EMAs with
        their median cost (the first run is left out when n >= 2: it carries one-off allocation / compile
        cost), then ``engine.reset()`` so no warm-up frame stays in the KV cache. Not counted in live stats."""
        if n < 0:
            raise ValueError(f"warmup chunk count must be >= 0, got {n}")
        if self.running:
            raise RuntimeError("warmup() must run before start(): the engine belongs to one thread")
        rng = np.random.default_rng(0)
        image = rng.integers(0, 256, size=image_shape, dtype=np.uint8)
        prefill, decode_per_token, totals = [], [], []
        for i in range(n):
            t0 = self._time_ns()
            tokens = self.engine.encode_frame(image)
            # forcing on: warm-up forces a step too, so a backend refusing it fails configure, by name
            kw = {"forced_bins": np.asarray(result.chunk_bins)[:1]} if i and self.committed.active else {}
            result = self.engine.run_chunk(tokens, -(i + 1), False, **kw)
            total_ms = (self._time_ns() - t0) / 1e6
            decode_ms = min(max(float(result.decode_ms), 0.0), total_ms)
            prefill.append(total_ms - decode_ms)
            decode_per_token.append(decode_ms / self.decode_tokens)
            totals.append(total_ms)
        self.engine.reset()
        self._prev_pooled = None
        figures: dict[str, Any] = {"chunks": n, "chunk_ms": totals}
        if n:
            use = slice(1, None) if n >= 2 else slice(None)
            p = float(np.median(prefill[use]))
            d = float(np.median(decode_per_token[use]))
            self.admission.seed(p, d)
            figures.update(prefill_ms=p, decode_ms_per_token=d, **self.deadline_fit())
        self.warmup_figures = figures
        self._emit("warmup_done", dict(figures))
        return figures

    def deadline_fit(self) -> dict[str, Any]:
        """The admission estimate of a chunk against the most time a chunk can ever be given (a frame taken at the
        start of its cycle: deadline_ms, or with overlapping chunks the executing chunk's remaining steps, minus
        safety_margin_ms; ChunkSchedule.deadline_ms). ``fits`` False means every chunk is refused (the
        robot repeats / holds, save the periodic probes) until the estimate comes down: a GPU too slow for the
        model, or a deadline too tight for it. None before any estimate exists (the first chunk is admitted)."""
        adm = self.admission
        budget = self.schedule.deadline_ms(adm.deadline_ms, self._step_ns() / 1e6) - adm.safety_margin_ms
        if not adm.seeded:
            return {"estimate_ms": None, "budget_ms": budget, "fits": None}
        estimate = adm.estimate_ms(self.decode_tokens)
        return {"estimate_ms": estimate, "budget_ms": budget, "fits": estimate <= budget}

    # ---- one cycle --------------------------------------------------------------------------------------
    def _salient(self, tokens: np.ndarray) -> bool:
        pooled = np.asarray(tokens, dtype=np.float32).reshape(len(tokens), -1).mean(axis=0)
        prev, self._prev_pooled = self._prev_pooled, pooled
        if prev is None or prev.shape != pooled.shape:
            return True  # first frame (or after a reset): a new scene for the cache
        return cosine_distance(pooled, prev) > self.saliency_threshold

    def _engine_needs_reset(self, exc: BaseException) -> bool:
        flag = getattr(self.engine, "needs_reset", False)
        try:
            flag = flag() if callable(flag) else flag
        except Exception:
            flag = True  # cannot even ask: assume the worst
        return bool(flag) or isinstance(exc, MemoryError)

    def step(self, frame: Any) -> str:
        """Decide and (maybe) run one chunk for ``frame`` in the current cycle. Returns the outcome."""
        self.frames_taken += 1
        now = self._time_ns()
        self._served_cycle = self.clock.cycle_index(now)
        cycle_start = self.clock.cycle_start(now)
        deadline_ns = self.schedule.deadline_ns(cycle_start, self.admission.deadline_ms, self._step_ns())
        decision = self.admission.decide((deadline_ns - now) / 1e6, self.decode_tokens)
        if not decision.admit:
            self.refused += 1
            self.last_outcome = REFUSED
            return REFUSED
        self.admitted += 1
        self.probes += decision.probe
        frame_id = getattr(frame, "frame_id", None)
        stamp_ns = int(getattr(frame, "stamp_ns", 0) or 0)
        received_ns = int(getattr(frame, "received_ns", 0) or 0)  # the camera node's clock, as the stamp
        age_ms = (received_ns - stamp_ns) / 1e6 if stamp_ns and received_ns else 0.0
        forced = self.committed.forced_bins(stamp_ns, decision.estimate_ms, self.admission.safety_margin_ms,
                                            self._step_ns(), frame_age_ms=age_ms)
        self._in_flight_since = now
        try:
            tokens = self.engine.encode_frame(frame.image)
            salient = self._salient(tokens)
            kw = {} if forced is None else {"forced_bins": forced}  # only when forcing: any engine runs without
            result = self.engine.run_chunk(tokens, frame_id, salient, **kw)
        except Exception as exc:
            end = self._time_ns()
            self._in_flight_since = None
            return self._chunk_failed(exc, frame_id, now, end, deadline_ns)
        end = self._time_ns()
        self._in_flight_since = None

        total_ms = (end - now) / 1e6
        decode_ms = min(max(float(getattr(result, "decode_ms", 0.0)), 0.0), total_ms)
        missed = end > deadline_ns
        self.admission.record(total_ms - decode_ms, decode_ms, self.decode_tokens, missed)
        self.chunk_ms.add(total_ms)
        self.completed += 1
        self.salient_frames += salient
        self.committed.ran(forced)
        try:
            result.salient = salient
        except AttributeError:
            pass
        late_ms = (end - deadline_ns) / 1e6
        if missed:
            self.deadline_misses += 1
            self._emit("deadline_miss", {"frame_id": frame_id, "chunk_ms": total_ms, "late_ms": late_ms,
                                         "estimate_ms": decision.estimate_ms, "probe": decision.probe})
        discard_after = self.late_discard_ms if self.late_discard_ms is not None else self.clock.period_ms
        if late_ms > discard_after:
            self.late_discarded += 1
            self.last_outcome = LATE
            self._emit("chunk_late_discarded", {"frame_id": frame_id, "late_ms": late_ms, "chunk_ms": total_ms})
            return LATE
        self._executing_start_ns = cycle_start
        self._executing_stamp_ns = stamp_ns or None
        try:
            result.frame_stamp_ns = stamp_ns
        except AttributeError:
            pass
        try:
            self.on_action(result, frame)
        except Exception as exc:
            self.callback_errors += 1
            self._emit("action_callback_error", {"frame_id": frame_id, "error": repr(exc)})
        self.committed.delivered(result, stamp_ns)
        self.last_outcome = ADMITTED
        return ADMITTED

    def _chunk_failed(self, exc: Exception, frame_id: Any, start: int, end: int, deadline_ns: int) -> str:
        self.errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        missed = end > deadline_ns
        if missed:
            self.deadline_misses += 1
            self.admission.count_miss()
        info = {"frame_id": frame_id, "error": self.last_error, "type": type(exc).__name__,
                "chunk_ms": (end - start) / 1e6, "missed_deadline": missed, "reset": False}
        if self._engine_needs_reset(exc):
            try:
                self.engine.reset()
                self.engine_resets += 1
                info["reset"] = True
            except Exception as reset_exc:
                info["reset_error"] = f"{type(reset_exc).__name__}: {reset_exc}"
            self._prev_pooled = None
        self._emit("chunk_error", info)
        self.last_outcome = ERROR
        return ERROR

    def in_flight_ms(self, now_ns: Optional[int] = None) -> float:
        """How long the current chunk has been running (0.0 when none): a watchdog input for hung chunks."""
        since = self._in_flight_since
        if since is None:
            return 0.0
        return ((self._time_ns() if now_ns is None else now_ns) - since) / 1e6

    def _step_ns(self) -> int:
        """A chunk step's period: ``step_ms`` when set (a policy trained at another rate than the cycles), else
        the cycle period."""
        return max(1, int(round((self.clock.period_ms if self.step_ms is None else self.step_ms) * 1e6)))

    def _chunk_due(self) -> bool:
        """Is a chunk due in this cycle (ChunkSchedule.due)? When not, the cycle is served without one.

        The executing chunk's steps are timed by its frame's stamp, so with stamped frames the next chunk is due
        once the newest frame is stamped e steps after it: with a camera slower than the cycles (5 Hz against 30)
        the chunk then starts when that frame arrives, not at a cycle boundary up to a camera period after it
        (when the frame would already be that much older, and its first steps past before the chunk is in).
        Unstamped frames, or no frame yet, use the cycle starts."""
        now = self._time_ns()
        step = self._step_ns()
        newest = self.buffer.peek() if self._executing_stamp_ns is not None else None
        stamp = int(getattr(newest, "stamp_ns", 0) or 0) if newest is not None else 0
        if stamp:
            due = self.schedule.due(stamp, self._executing_stamp_ns, step)
        else:
            due = self.schedule.due(self.clock.cycle_start(now), self._executing_start_ns, step)
        if due:
            return True
        self._served_cycle = self.clock.cycle_index(now)
        self.cycles_not_due += 1
        return False

    # ---- thread -----------------------------------------------------------------------------------------
    def _wait_next_cycle(self) -> None:
        """One chunk per cycle: once this cycle is served, sleep (interruptibly) to the next boundary."""
        now = self._time_ns()
        if self._served_cycle is not None and self.clock.cycle_index(now) <= self._served_cycle:
            self._stop.wait(max(0.0, (self.clock.next_deadline(now) - now) / 1e9))

    def _lower_thread_priority(self) -> None:
        """Linux nice is per thread (a TID is a PID to setpriority): lowering only this thread lets the
        camera callback and the 30 Hz action timer of the same process win a core over a running chunk when
        the CPU is oversubscribed (measured on 2 cores: consumer-side tick gaps up to 92 ms in a 30 min soak
        without it). Raising a nice value needs no privilege; failure is reported, not fatal."""
        if not self.thread_nice or not hasattr(os, "setpriority"):
            return
        tid = threading.get_native_id()
        try:
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + self.thread_nice)
            self.thread_nice_applied = os.getpriority(os.PRIO_PROCESS, tid)
        except OSError as e:
            self._emit("thread_priority_unchanged", {"error": str(e)})

    def _run(self) -> None:
        self._lower_thread_priority()
        self._emit("started", {})
        was_paused = False
        # A frame refused for lack of time late in a cycle is retried once at the start of the next cycle when
        # no newer frame has arrived by then (a slow camera would otherwise waste it); a newer frame wins.
        retry = None
        while not self._stop.is_set():
            try:
                self.apply_pending_updates()
                if not self._resumed.is_set():
                    was_paused, retry = True, None
                    self._resumed.wait(self.wait_timeout_s)
                    continue
                frame, is_retry = None, False
                if was_paused:
                    # A frame written before resume() is stale: drop it here, in the one reader thread; one
                    # written after resume() is processed at once.
                    was_paused = False
                    self._served_cycle = None
                    got = self.buffer.read_latest_with_seq()
                    if got is not None:
                        if got[0] <= self._resume_written:
                            self.dropped_while_paused += 1
                        else:
                            frame = got[1]
                if frame is None:
                    self._wait_next_cycle()
                    if self._stop.is_set():
                        break
                    if not self._chunk_due():
                        continue
                    frame = self.buffer.read_latest()
                    if frame is None and retry is not None:
                        frame, is_retry = retry, True
                        self.retried += 1
                    retry = None
                    if frame is None:
                        frame = self.buffer.wait_latest(self.wait_timeout_s)
                if frame is None or self._stop.is_set():
                    continue
                if not self._resumed.is_set():  # paused while we waited: the frame is not ours to process
                    self.dropped_while_paused += 1
                    was_paused = True
                    continue
                if self.step(frame) == REFUSED and not is_retry:
                    retry = frame
            except Exception as exc:  # a bug outside the chunk: report, back off one period, keep going
                self.errors += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                self._emit("loop_error", {"error": self.last_error, "type": type(exc).__name__})
                self._stop.wait(self.clock.period_ms / 1e3)
        self._emit("stopped", {})

    def start(self) -> None:
        if self.running:
            raise RuntimeError("inference loop already running")
        self._stop.clear()
        self.clock.set_period_ms(self.clock.period_ms, start_ns=self._time_ns())
        self._served_cycle = None
        self._executing_start_ns = self._executing_stamp_ns = None
        self.committed.forget()
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def pause(self) -> None:
        """Stop admitting chunks (the chunk in flight, if any, completes)."""
        self._resumed.clear()
        self._emit("paused", {})

    def resume(self) -> None:
        """Resume; frames that arrived while paused are discarded (counted) by the loop thread, so the first
        chunk after resuming uses a frame received after it."""
        self._resume_written = self.buffer.written
        # the action side held while paused: nothing is executing
        self._executing_start_ns = self._executing_stamp_ns = None
        self.committed.forget()
        self._resumed.set()
        self._emit("resumed", {})

    # ---- figures ----------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {
            "running": self.running,
            "paused": self.paused,
            "thread_nice": self.thread_nice_applied,
            **{name: getattr(self, name) for name in COUNTERS},
            "chunk_schedule": {**self.schedule.stats(), "step_ms": self._step_ns() / 1e6},
            "committed_prefix": self.committed.stats(),
            "last_error": self.last_error,
            "in_flight_ms": self.in_flight_ms(),
            "chunk_ms": self.chunk_ms.summary(),
            "period_ms": self.clock.period_ms,
            "saliency_threshold": self.saliency_threshold,
            "admission": self.admission.stats(),
            "deadline_fit": self.deadline_fit(),
            "frames": self.buffer.stats(),
            "warmup": dict(self.warmup_figures),
        }
