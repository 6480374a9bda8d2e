"""Decides, on every action-publisher tick, what the robot is commanded: fresh, repeat or hold.

* ``fresh``  — an action arrived since the previous tick: publish it.
* ``repeat`` — nothing new, inputs still live: repeat the last command (the fallback for a refused / late chunk).
* ``hold``   — safe stop: zero on every motion dimension, the gripper left at its last commanded value (opening
  or closing a gripper is not a "safe" default, keeping it is). Chosen when nothing was ever received, when the
  newest camera frame or the newest action was *received* longer than ``stale_after_ms`` ago, or while an
  explicit stale reason is active (QoS deadline missed, liveliness lost, frozen camera, inference deactivated).

Staleness is measured on the local receive clock (``now_ns`` passed by the caller), not on the frame stamps:
stamps may come from another machine (robot ↔ edge split) or a replayed bag. The frame stamp is carried through
for consumers and reported as ``age_ms``.

After a hold the arbiter does not fall back to repeating a pre-hold command: the last command *is* the hold,
so it keeps holding until a fresh action arrives.

Thread-safe: ``offer`` from the inference thread or a subscription, ``note_frame`` from the camera callback,
``tick`` from the timer, stale marks from middleware event callbacks; one short lock guards the state.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Optional

import numpy as np

from vla_edge_ros.core.stale_inputs import StaleInputs

FRESH, REPEAT, HOLD = "fresh", "repeat", "hold"
KINDS = (FRESH, REPEAT, HOLD)


@dataclass(frozen=True)
class TickDecision:
    kind: str  # 'fresh' | 'repeat' | 'hold'
    values: np.ndarray  # (action_dims,) float64 command for this tick (a private copy)
    source_stamp_ns: int  # camera stamp of the frame the command came from; for a hold, the newest action's
    #                       frame stamp (what it holds instead of); 0 when no action was ever received
    age_ms: float  # now - source_stamp_ns in ms (NaN when there is no source)
    seq: int  # sequence number of the source action (1, 2, ... in offer order; 0 when none)
    reason: str  # why this kind: 'new_action', 'no_new_action', 'no_action_yet', 'frame_stale', ...


class ActionArbiter(StaleInputs):
    def __init__(self, action_dims: int = 7, gripper_index: int = 6, stale_after_ms: float = 200.0,
                 initial_gripper: float = 0.0) -> None:
        if action_dims < 1:
            raise ValueError(f"action_dims must be >= 1, got {action_dims}")
        if gripper_index is not None and not 0 <= gripper_index < action_dims:
            raise ValueError(f"gripper_index {gripper_index} outside 0..{action_dims - 1}")
        self.action_dims = int(action_dims)
        self.gripper_index = gripper_index
        self._lock = threading.Lock()
        self._stale_after_ns = 0
        self.set_stale_after_ms(stale_after_ms)
        # newest accepted action
        self._action: Optional[np.ndarray] = None
        self._action_stamp_ns = 0
        self._action_received_ns: Optional[int] = None
        self._action_seq = 0
        self._fresh_pending = False
        # newest frame (receive time); None until the camera delivers one (the robot side of a split may never)
        self._frame_received_ns: Optional[int] = None
        self._frame_stamp_ns = 0
        self.frames_noted = 0
        # last command actually published
        self._last_values = np.zeros(self.action_dims, dtype=np.float64)
        if gripper_index is not None:
            self._last_values[gripper_index] = float(initial_gripper)
        self._last_kind: Optional[str] = None
        self._last_source_stamp_ns = 0
        self._last_seq = 0
        self._stale_reasons: dict[str, int] = {}  # reason -> times marked
        self.counts = {FRESH: 0, REPEAT: 0, HOLD: 0}
        self.hold_reasons: dict[str, int] = {}
        self.offered = 0
        self.stamp_resets = 0
        self.rejected: dict[str, int] = {}
        self.last_reject_message = ""

    # ---- inputs -----------------------------------------------------------------------------------------
    def offer(self, action: np.ndarray, frame_stamp_ns: int, now_ns: int) -> bool:
        """A new action (from inference or the fresh-action topic). Returns False (counted) when rejected."""
        arr = np.asarray(action, dtype=np.float64).reshape(-1) if action is not None else None
        with self._lock:
            self.offered += 1
            if arr is None or arr.shape != (self.action_dims,):
                shape = None if arr is None else tuple(np.shape(action))
                return self._reject("bad_shape", f"action has shape {shape}, expected ({self.action_dims},)")
            if not np.all(np.isfinite(arr)):
                return self._reject("non_finite", f"action contains NaN/inf: {arr.tolist()}")
            back_ns = self._action_stamp_ns - int(frame_stamp_ns)
            if self._action is not None and back_ns > 0:
                if back_ns <= self._stale_after_ns:
                    # A late, reordered message (e.g. over the network) must not replace a newer command.
                    return self._reject("out_of_order", f"action for frame stamp {int(frame_stamp_ns)} arrived "
                                                        f"after one for {self._action_stamp_ns}")
                # A jump back by more than the staleness limit is a restarted source (looping bag, camera
                # restarted with another clock), not reordering: accept it, or the arbiter would hold forever.
                self.stamp_resets += 1
            self._action = arr.copy()
            self._action_stamp_ns = int(frame_stamp_ns)
            self._action_received_ns = int(now_ns)
            self._action_seq += 1
            self._fresh_pending = True
            return True

    def note_frame(self, frame_stamp_ns: int, now_ns: int) -> None:
        """The camera received a (valid) frame; its receive time feeds the staleness check."""
        with self._lock:
            self._frame_received_ns = int(now_ns)
            self._frame_stamp_ns = int(frame_stamp_ns)
            self.frames_noted += 1


    # ---- the tick ---------------------------------------------------------------------------------------
    def _hold_reason(self, now_ns: int) -> Optional[str]:
        if self._stale_reasons:
            return "stale:" + ",".join(sorted(self._stale_reasons))
        if self._action is None:
            return "no_action_yet"
        if self._frame_received_ns is not None and now_ns - self._frame_received_ns > self._stale_after_ns:
            return "frame_stale"
        if now_ns - self._action_received_ns > self._stale_after_ns:
            return "action_stale"
        return None

    def tick(self, now_ns: int) -> TickDecision:
        now_ns = int(now_ns)
        with self._lock:
            fresh = self._fresh_pending
            self._fresh_pending = False  # an action that arrives while holding is consumed by the hold
            reason = self._hold_reason(now_ns)
            if reason is None and not fresh and self._last_kind in (None, HOLD):
                reason = "awaiting_fresh"  # never repeat a pre-hold command
            if reason is not None:
                kind = HOLD
                values = np.zeros(self.action_dims, dtype=np.float64)
                if self.gripper_index is not None:
                    values[self.gripper_index] = self._last_values[self.gripper_index]
                stamp, seq = self._action_stamp_ns, self._action_seq
                self.hold_reasons[reason] = self.hold_reasons.get(reason, 0) + 1
            elif fresh:
                kind, reason = FRESH, "new_action"
                values = self._action.copy()
                stamp, seq = self._action_stamp_ns, self._action_seq
            else:
                kind, reason = REPEAT, "no_new_action"
                values = self._last_values.copy()
                stamp, seq = self._last_source_stamp_ns, self._last_seq
            self._last_values = values
            self._last_kind = kind
            self._last_source_stamp_ns, self._last_seq = stamp, seq
            self.counts[kind] += 1
        age_ms = (now_ns - stamp) / 1e6 if seq else math.nan
        return TickDecision(kind=kind, values=values.copy(), source_stamp_ns=stamp, age_ms=age_ms, seq=seq,
                            reason=reason)

    def stats(self) -> dict:
        with self._lock:
            return {
                "ticks": dict(self.counts),
                "hold_reasons": dict(self.hold_reasons),
                "offered": self.offered,
                "stamp_resets": self.stamp_resets,
                "rejected": dict(self.rejected),
                "last_reject_message": self.last_reject_message,
                "stale_reasons": sorted(self._stale_reasons),
                "frames_noted": self.frames_noted,
                "stale_after_ms": self._stale_after_ns / 1e6,
                "last_kind": self._last_kind,
            }
