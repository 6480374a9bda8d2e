"""Plays action chunks at the control rate while the next chunk is computed: what is commanded on each tick.

A policy that emits a chunk of H future actions (one per control period ``dt``) lets the arm keep moving while
the next inference runs; the executor decides, at each tick, which step of which chunk is due.

* Timing. Step ``k`` of a chunk is due at ``frame_stamp + k * dt``: the step due at ``now`` is
  ``k = floor((now - frame_stamp) / dt)``. Steps whose time has already passed when the chunk arrives are
  skipped (latency compensation: they were planned for a robot state that is gone), and counted. This needs
  the frame stamps and ``now_ns`` on one clock (the node's ROS clock; a split needs synchronised clocks), so a
  stamp from the future beyond ``future_tolerance_ms`` is rejected as a clock error.
* Kinds, as in ``ActionArbiter``: ``fresh`` (the first step taken from a new chunk); ``repeat`` with reason
  ``next_step`` / ``same_step`` (a later step, or the same one again on a tick faster than ``dt``) or
  ``ran_out`` (the last step once the chunk has run out, while inputs are still live); ``hold`` (zero motion,
  gripper left at its last command) when nothing arrived yet, while an explicit stale reason is active (those
  hold at once, mid-chunk too), or once the chunk has run out and the newest frame or chunk was *received*
  longer than ``stale_after_ms`` ago. Within a chunk's horizon a silent camera does not stop the arm: the
  chunk is the plan made for exactly that time. After a hold the executor waits for a chunk offered after it
  (never resumes a pre-hold plan).
* H = 1 is ``ActionArbiter`` exactly, whatever ``dt`` and the stamps: a single step is a plan only for the tick
  that first plays it (every later tick is a repeat with reason ``no_new_action``, inputs checked on every
  tick), there is nothing to merge (every scheme is ``latest``), and the stamp is provenance only, so it is not
  checked against the clock (a robot/edge split with unsynchronised clocks must not hold because of skew).
* Merging overlapping chunks:
  ``latest`` — the newest chunk wins from its first due step.
  ``temporal_ensemble`` (ACT) — the step due now is the average of every live chunk's prediction for this
  absolute time, weights ``exp(-m * i)``, ``i`` the age rank among them (0 = oldest, as ACT does: older
  predictions weigh more, which smooths).
  ``blend`` (Real-Time-Chunking-like) — on arrival, the first ``d = ceil(latency / dt)`` steps of the new chunk
  are replaced by what the executing chunk commits for those times (they are being executed while the new one
  was computed), then ``blend_steps`` steps blend linearly into the new chunk. The executing chunk's step for
  the new chunk's step j is the one in effect at the middle of j's window (``window_mid_ns``), not at its start:
  with stamps a whole number of steps apart plus jitter, the start falls a step back half the time. Only times
  the executing chunk has a step for are replaced: a chunk that ran out commits nothing (its repeated last step
  is a fallback).
  ``committed_prefix`` gives the same steps ahead of time, for token models that force-decode them.
* Admission: ``runs_out_ns()`` is when the executing plan's last step is due. The inference loop models the same
  time on its own clock (core/chunk_schedule.py: the next chunk starts once the executing one has played
  ``execution_horizon_steps`` steps and must be in before it runs out, minus the safety margin).

Bad input (wrong shape, empty, NaN/inf, dt <= 0, a stamp from the future (H > 1), a stamp older than the newest
chunk's by up to ``stale_after_ms``: a reordered message) is rejected, counted by reason, and the executor goes on
with what it had. A jump back by more is a restarted source and is accepted (counted), as in ``ActionArbiter``.

Thread-safe: ``offer`` from the inference thread, ``note_frame`` from the camera callback, ``tick`` from the
timer, stale marks from middleware events; one short lock guards the state.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from vla_edge_ros.core.stale_inputs import StaleInputs
from vla_edge_ros.core.action_arbiter import FRESH, HOLD, REPEAT

LATEST, TEMPORAL_ENSEMBLE, BLEND = "latest", "temporal_ensemble", "blend"
MERGES = (LATEST, TEMPORAL_ENSEMBLE, BLEND)
MAX_LIVE_CHUNKS = 64  # temporal ensemble: offers faster than dt would otherwise pile up; evictions are counted


@dataclass(frozen=True)
class ChunkTick:
    """Same fields as ``ActionArbiter``'s ``TickDecision`` (a drop-in for the action node), plus the step."""
    kind: str  # 'fresh' | 'repeat' | 'hold'
    values: np.ndarray  # (action_dims,) float64 command for this tick (a private copy)
    source_stamp_ns: int  # frame stamp of the chunk the step comes from (newest chunk's for a hold; 0: none)
    age_ms: float  # now - source_stamp_ns in ms (NaN when there is no source)
    seq: int  # sequence number of that chunk (1, 2, ... in accepted-offer order; 0 when none)
    reason: str  # 'new_chunk', 'next_step', 'same_step', 'ran_out', or the hold reason
    step: int  # index of the step in that chunk (-1 for a hold)
    merged: int  # how many chunks contributed (temporal ensemble; 1 otherwise, 0 for a hold)


def window_mid_ns(stamp_ns: int, j: int, dt_ns: int) -> int:
    """The middle of step ``j``'s window [stamp + j * dt, stamp + (j + 1) * dt) of a chunk stamped ``stamp_ns``:
    where another chunk's step for the same control instant is read (blend's committed steps and ramp,
    ``committed_prefix``, core/committed_prefix.py). Frames of a camera synchronised with the control are stamped
    a whole number of steps apart give or take a little jitter; read at the window's start, a frame stamped a
    hair early (half of them) names the step before, one the robot has already executed (issue 22). The middle
    takes the step covering most of the window: the same instant whatever the jitter below half a step."""
    return int(stamp_ns) + int(j) * int(dt_ns) + int(dt_ns) // 2


class _Chunk:
    __slots__ = ("values", "stamp_ns", "dt_ns", "seq", "received_ns", "last_step")

    def __init__(self, values: np.ndarray, stamp_ns: int, dt_ns: int, seq: int, received_ns: int) -> None:
        self.values, self.stamp_ns, self.dt_ns, self.seq, self.received_ns = values, stamp_ns, dt_ns, seq, received_ns
        self.last_step: Optional[int] = None  # last step index played; None until the chunk is first used

    def raw_step(self, t_ns: int) -> int:
        """Step due at ``t_ns`` (>= 0: a stamp within the future tolerance is due now; may be past the end)."""
        return max(0, (t_ns - self.stamp_ns) // self.dt_ns)

    def step_at(self, t_ns: int) -> Optional[int]:
        """Step due at ``t_ns``, or None when the chunk has no step for that time (it has run out)."""
        k = self.raw_step(t_ns)
        return k if k < len(self.values) else None


class ChunkExecutor(StaleInputs):
    def __init__(self, action_dims: int = 7, horizon: int = 1, merge: str = LATEST, gripper_index: Optional[int] = 6,
                 stale_after_ms: float = 200.0, initial_gripper: float = 0.0, ensemble_m: float = 0.01,
                 blend_steps: int = 4, future_tolerance_ms: float = 5.0) -> None:
        if action_dims < 1 or horizon < 1:
            raise ValueError(f"action_dims and horizon must be >= 1, got {action_dims}, {horizon}")
        if gripper_index is not None and not 0 <= gripper_index < action_dims:
            raise ValueError(f"gripper_index {gripper_index} outside 0..{action_dims - 1}")
        if merge not in MERGES:
            raise ValueError(f"merge must be one of {', '.join(MERGES)}, got {merge!r}")
        if not (math.isfinite(ensemble_m) and ensemble_m >= 0.0):
            raise ValueError(f"ensemble_m must be a finite number >= 0, got {ensemble_m!r}")
        if int(blend_steps) != blend_steps or blend_steps < 0:
            raise ValueError(f"blend_steps must be an integer >= 0, got {blend_steps!r}")
        if not (math.isfinite(future_tolerance_ms) and future_tolerance_ms >= 0.0):
            raise ValueError(f"future_tolerance_ms must be a finite number >= 0, got {future_tolerance_ms!r}")
        self.action_dims, self.horizon, self.merge = int(action_dims), int(horizon), merge
        self.gripper_index = gripper_index
        self.ensemble_m, self.blend_steps = float(ensemble_m), int(blend_steps)
        self._future_tolerance_ns = int(round(future_tolerance_ms * 1e6))
        self._lock = threading.Lock()
        self._stale_after_ns = 0
        self.set_stale_after_ms(stale_after_ms)
        self._chunks: list[_Chunk] = []  # usable chunks, oldest first; cleared by a hold (consumed by it)
        self._newest: Optional[_Chunk] = None  # newest accepted, even once consumed: staleness and ordering
        self._seq = 0
        self._frame_received_ns: Optional[int] = None
        self.frames_noted = 0
        self._last_values = np.zeros(self.action_dims, dtype=np.float64)
        if gripper_index is not None:
            self._last_values[gripper_index] = float(initial_gripper)
        self._last_kind: Optional[str] = None
        self._stale_reasons: dict[str, int] = {}
        self.counts = {FRESH: 0, REPEAT: 0, HOLD: 0}
        self.repeat_reasons: dict[str, int] = {}
        self.hold_reasons: dict[str, int] = {}
        self.offered = self.accepted = self.stamp_resets = self.merges = self.evicted = 0
        self.committed_steps_kept = 0  # blend: steps of new chunks replaced by the committed plan
        self.skipped_latency = 0  # steps of new chunks already past when first used
        self.skipped_gap = 0  # steps jumped over between two ticks of the same chunk (late / irregular ticks)
        self.rejected: dict[str, int] = {}
        self.last_reject_message = ""
        self.horizon_changes = 0
        # Called after each accepted offer, outside the lock, on the offering thread, with (plan (H, D) copy:
        # the chunk as stored, blend's rewrite included; frame_stamp_ns, dt_ns, now_ns). The action node
        # publishes the chunk as a trajectory from it; it must not raise (the offerer is the inference loop).
        self.on_accept: Optional[Callable[[np.ndarray, int, int, int], None]] = None

    def set_horizon(self, horizon: int) -> None:
        """Change H (a new checkpoint configured, or the robot side of a split following its edge): the plan of
        the old shape is dropped (the next tick holds until a chunk of the new shape arrives); counted."""
        if isinstance(horizon, bool) or int(horizon) != horizon or horizon < 1:
            raise ValueError(f"horizon must be an integer >= 1, got {horizon!r}")
        with self._lock:
            if int(horizon) == self.horizon:
                return
            self.horizon = int(horizon)
            self._chunks.clear()
            self.horizon_changes += 1

    # ---- inputs -----------------------------------------------------------------------------------------
    def offer(self, chunk: np.ndarray, frame_stamp_ns: int, dt_ns: int, now_ns: int) -> bool:
        """A new chunk (H x action_dims; a flat action_dims vector when H = 1) computed from the frame stamped
        ``frame_stamp_ns``, one step per ``dt_ns``. Returns False (counted by reason) when rejected."""
        arr, unreadable = None, ""
        try:
            arr = None if chunk is None else np.array(chunk, dtype=np.float64)  # a private copy
        except (TypeError, ValueError) as e:  # ragged or non-numeric
            unreadable = f"chunk is not a numeric array: {e}"
        if arr is not None and self.horizon == 1 and arr.ndim == 1:
            arr = arr.reshape(1, -1)
        stamp, dt, now = int(frame_stamp_ns), int(dt_ns), int(now_ns)
        with self._lock:
            self.offered += 1
            if unreadable:
                return self._reject("bad_shape", unreadable)
            if arr is None or arr.size == 0:
                return self._reject("empty", f"chunk is empty ({None if arr is None else arr.shape})")
            if arr.shape != (self.horizon, self.action_dims):
                return self._reject("bad_shape", f"chunk has shape {arr.shape}, expected "
                                                 f"({self.horizon}, {self.action_dims})")
            if not np.all(np.isfinite(arr)):
                where = np.argwhere(~np.isfinite(arr))[:4].tolist()
                return self._reject("non_finite", f"chunk contains NaN/inf at (step, dim) {where}")
            if dt <= 0:
                return self._reject("bad_dt", f"dt_ns must be > 0, got {dt}")
            if self.horizon > 1 and stamp - now > self._future_tolerance_ns:
                return self._reject("future_stamp", f"frame stamp {stamp} is {(stamp - now) / 1e6:.3f} ms ahead of "
                                                    f"now {now} (tolerance {self._future_tolerance_ns / 1e6} ms)")
            reset = False
            if self._newest is not None and self._newest.stamp_ns > stamp:
                if self._newest.stamp_ns - stamp <= self._stale_after_ns:
                    # A late, reordered chunk must not replace a plan made from a newer frame.
                    return self._reject("out_of_order", f"chunk for frame stamp {stamp} arrived after one for "
                                                        f"{self._newest.stamp_ns}")
                reset = True  # a jump back by more than the staleness limit: a restarted source, not reordering
                self.stamp_resets += 1
                self._chunks.clear()
            self._seq += 1
            new = _Chunk(arr, stamp, dt, self._seq, now)
            if self._chunks and not reset:
                self._merge_in_locked(new, now)
            self._chunks.append(new)
            if len(self._chunks) > MAX_LIVE_CHUNKS:
                self.evicted += len(self._chunks) - MAX_LIVE_CHUNKS
                del self._chunks[:-MAX_LIVE_CHUNKS]
            self._newest = new
            self.accepted += 1
            listener = self.on_accept
            plan = new.values.copy() if listener is not None else None
        if listener is not None:
            listener(plan, stamp, dt, now)
        return True

    def _merge_in_locked(self, new: _Chunk, now: int) -> None:
        old = self._chunks[-1]
        if self.horizon == 1:  # one step: nothing to merge, the newest wins (ActionArbiter)
            self._chunks.clear()
            return
        if self.merge == TEMPORAL_ENSEMBLE:
            return  # merged per tick; old chunks stay until they run out (pruned at each tick)
        if old.step_at(now) is not None:
            self.merges += 1  # superseded while it still had steps (blend: and rewritten below)
        if self.merge == BLEND:
            d = max(0, -(-(now - new.stamp_ns) // new.dt_ns))  # ceil(latency / dt)
            for j in range(min(self.horizon, d + self.blend_steps)):
                k_old = old.step_at(window_mid_ns(new.stamp_ns, j, new.dt_ns))  # the same control instant
                if k_old is None:
                    break  # the executing chunk has nothing planned from here on: nothing committed
                if j < d:
                    new.values[j] = old.values[k_old]
                    self.committed_steps_kept += 1
                else:
                    w = (j - d + 1) / (self.blend_steps + 1)
                    new.values[j] = (1.0 - w) * old.values[k_old] + w * new.values[j]
        self._chunks.clear()  # latest / blend: only the newest (possibly rewritten) chunk is the plan

    def note_frame(self, frame_stamp_ns: int, now_ns: int) -> None:
        """The camera received a (valid) frame; its receive time feeds the staleness check."""
        with self._lock:
            self._frame_received_ns = int(now_ns)
            self.frames_noted += 1


    # ---- the plan ---------------------------------------------------------------------------------------
    def _plan_at_locked(self, t: int):
        """(values, source chunk, step in it, ran_out, chunks merged) for time ``t``; None without a plan."""
        if not self._chunks:
            return None
        if self.horizon == 1:  # a plan only for the tick that plays it first: later ticks check the inputs
            c = self._chunks[-1]
            return c.values[0], c, 0, True, 1
        if self.merge == TEMPORAL_ENSEMBLE:
            live = [(c, k) for c in self._chunks if (k := c.step_at(t)) is not None]  # oldest first
            if len(live) > 1:
                w = np.exp(-self.ensemble_m * np.arange(len(live)))
                values = (w[:, None] * np.stack([c.values[k] for c, k in live])).sum(axis=0) / w.sum()
                return values, live[-1][0], live[-1][1], False, len(live)
            if live:
                c, k = live[0]
                return c.values[k], c, k, False, 1
        c = self._chunks[-1]
        k = c.step_at(t)
        if k is None:
            return c.values[-1], c, self.horizon - 1, True, 1
        return c.values[k], c, k, False, 1

    def committed_prefix(self, now_ns: int, d: int) -> np.ndarray:
        """The steps the executing plan commands for the windows [now_ns + j * dt, now_ns + (j + 1) * dt), j < d
        (pass the stamp of the frame the next chunk is computed from), each read at the window's middle
        (``window_mid_ns``): (n, action_dims) with n <= d, fewer where the plan runs out, (0, D) while nothing is
        executing. Token models force-decode these as the new chunk's first steps."""
        if d < 0:
            raise ValueError(f"d must be >= 0, got {d}")
        rows = []
        with self._lock:
            if self._chunks:
                dt = self._chunks[-1].dt_ns
                for j in range(int(d)):
                    plan = self._plan_at_locked(window_mid_ns(int(now_ns), j, dt))
                    if plan[3]:
                        break
                    rows.append(np.array(plan[0], dtype=np.float64))
        return np.array(rows, dtype=np.float64).reshape(len(rows), self.action_dims)

    def runs_out_ns(self) -> Optional[int]:
        """When the executing plan's last step is due (ns); None while nothing is executing."""
        with self._lock:
            if not self._chunks:
                return None
            return max(c.stamp_ns + (len(c.values) - 1) * c.dt_ns for c in self._chunks)

    # ---- the tick ---------------------------------------------------------------------------------------
    def _input_stale_locked(self, now: int) -> Optional[str]:
        if self._frame_received_ns is not None and now - self._frame_received_ns > self._stale_after_ns:
            return "frame_stale"
        if now - self._newest.received_ns > self._stale_after_ns:
            return "action_stale"
        return None

    def tick(self, now_ns: int) -> ChunkTick:
        now = int(now_ns)
        with self._lock:
            if self.merge == TEMPORAL_ENSEMBLE and len(self._chunks) > 1:  # the newest stays: it is repeated
                self._chunks = [c for c in self._chunks[:-1] if c.step_at(now) is not None] + self._chunks[-1:]
            plan = None
            if self._stale_reasons:
                reason = "stale:" + ",".join(sorted(self._stale_reasons))
            elif self._newest is None:
                reason = "no_action_yet"
            else:
                plan = self._plan_at_locked(now)
                reason = self._input_stale_locked(now) if plan is None or plan[3] else None
                if reason is None and plan is None:
                    reason = "awaiting_fresh"  # never resume a plan made before a hold
            if reason is not None:
                kind, step, merged = HOLD, -1, 0
                values = np.zeros(self.action_dims, dtype=np.float64)
                if self.gripper_index is not None:
                    values[self.gripper_index] = self._last_values[self.gripper_index]
                src = self._newest
                self.hold_reasons[reason] = self.hold_reasons.get(reason, 0) + 1
                self._chunks.clear()  # consumed by the hold
            else:
                values, src, step, ran_out, merged = plan
                values = np.array(values, dtype=np.float64)
                if src.last_step is None:
                    kind, reason = FRESH, "new_chunk"
                    self.skipped_latency += step
                else:
                    kind = REPEAT
                    reason = "ran_out" if ran_out else ("same_step" if step == src.last_step else "next_step")
                    if self.horizon == 1:
                        reason = "no_new_action"  # the arbiter's word: with one step every repeat is this
                    self.skipped_gap += max(0, step - src.last_step - 1)
                    self.repeat_reasons[reason] = self.repeat_reasons.get(reason, 0) + 1
                src.last_step = step
                self.merges += merged > 1
            self._last_values, self._last_kind = values, kind
            self.counts[kind] += 1
            stamp, seq = (src.stamp_ns, src.seq) if src is not None else (0, 0)
        age_ms = (now - stamp) / 1e6 if seq else math.nan
        return ChunkTick(kind=kind, values=values.copy(), source_stamp_ns=stamp, age_ms=age_ms, seq=seq,
                         reason=reason, step=step, merged=merged)

    def stats(self) -> dict:
        with self._lock:
            return {
                "merge": self.merge, "horizon": self.horizon,
                "ticks": dict(self.counts), "repeat_reasons": dict(self.repeat_reasons),
                "hold_reasons": dict(self.hold_reasons),
                "offered": self.offered, "accepted": self.accepted, "rejected": dict(self.rejected),
                "last_reject_message": self.last_reject_message, "stamp_resets": self.stamp_resets,
                "skipped_latency": self.skipped_latency, "skipped_gap": self.skipped_gap,
                "merges": self.merges, "committed_steps_kept": self.committed_steps_kept, "evicted": self.evicted,
                "live_chunks": len(self._chunks), "horizon_changes": self.horizon_changes,
                "newest_seq": self._newest.seq if self._newest is not None else 0,
                "stale_reasons": sorted(self._stale_reasons),
                "frames_noted": self.frames_noted, "stale_after_ms": self._stale_after_ns / 1e6,
                "last_kind": self._last_kind,
            }
