"""Which steps a new action chunk must force-decode so that it starts with what the robot has already committed
(issue 22, Real-Time-Chunking-like ``chunk_merge: blend``). Pure: no clock, no engine; the inference loop calls it.

Why: with ``blend`` the action publisher's executor (core/executor.py) keeps, when a chunk arrives, its first
d = ceil(latency / dt) steps as the executing chunk planned them: those were being played while the new chunk was
computed. A token model can do better than having its own first steps overwritten: decode the chunk with those
steps forced (teacher forcing, engine/interface.py "Forced prefix"), so that its later steps are planned as a
continuation of what is actually executed. The loop cannot know the latency before the chunk has run, so it
predicts it from what admission assumes the chunk will take:

    d = ceil((frame age at receipt + admission estimate ms + safety_margin_ms) / step ms), clipped to [0, H]

(the executor counts the latency from the frame's stamp; the frame's age at receipt, receive time - stamp on
one clock, was missing until issue 22's review: in the 100 ms run of chunk_compare the loop forced 1455 steps
where the executor kept 1819, its estimate ~195 ms + 2 against a step of 200 ms while frames were ~40 ms old
when the chunk started; the wait in the buffer after receipt, up to a cycle, is on another clock and still not
counted)

and forces, for the new chunk's steps j < d (step j due over [new frame stamp + j * step, + step)), the executing
chunk's step in effect in the middle of that window, k = floor((new stamp + (j + 1/2) * step - executing stamp)
/ step): the executor's rule (``ChunkExecutor.committed_prefix``, blend's merge, ``executor.window_mid_ns``; unit
tests hold them equal). Read at the window's start instead, a frame stamped a hair before the whole number of
steps after the executing one (a camera synchronised with the control, jitter either way: half the chunks) would
force the step before, one the robot already executed (issue 22; test/test_committed_alignment.py).
A step k >= H is past the executing chunk's end: it commits nothing from there on (its repeated last step is a
fallback, not a plan), so the prefix can be shorter than d. Nothing is forced when the new frame is stamped before
the executing chunk's (a reordered or restarted source: the executor rejects or resets) or either is unstamped.

What is forced is the executing chunk's decoded bins (``ChunkResult.chunk_bins``), so its own forced prefix
included; the executor's blend ramp (``blend_steps`` after the committed ones) mixes old and new values that no
bins describe, so a prefix reaching into that ramp forces the previous chunk's bins there, not the mix. With
``action_readout: expectation`` the executor played each slot's softmax mean while the bins forced are still the
argmax ones, not the bins of the played means (they part where a slot's distribution is wide or skewed).
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from vla_edge_ros.core.executor import window_mid_ns


def forced_step_count(estimate_ms: float, safety_margin_ms: float, step_ms: float, horizon: int) -> int:
    """d: the steps that will have been played when the chunk arrives, predicted (module docstring)."""
    if not step_ms > 0.0:
        raise ValueError(f"step_ms must be > 0, got {step_ms!r}")
    latency = max(0.0, float(estimate_ms)) + max(0.0, float(safety_margin_ms))
    return int(min(max(0, math.ceil(latency / float(step_ms))), int(horizon)))


def committed_bins(prev_bins: np.ndarray, prev_stamp_ns: int, new_stamp_ns: int, step_ns: int, d: int) -> np.ndarray:
    """(n, action_dims) int64, n <= d: the executing chunk's (``prev_bins``, (H, action_dims), frame stamped
    ``prev_stamp_ns``) steps in effect at new_stamp + j * step for j < d (module docstring)."""
    prev = np.asarray(prev_bins, dtype=np.int64)
    step, prev_stamp, new_stamp = int(step_ns), int(prev_stamp_ns), int(new_stamp_ns)
    if step <= 0:
        raise ValueError(f"step_ns must be > 0, got {step_ns!r}")
    rows: list[np.ndarray] = []
    if prev_stamp > 0 and new_stamp >= prev_stamp:
        for j in range(max(0, int(d))):
            k = (window_mid_ns(new_stamp, j, step) - prev_stamp) // step
            if k >= len(prev):
                break  # the executing chunk has nothing planned from here on
            rows.append(prev[k])
    return np.array(rows, dtype=np.int64).reshape(len(rows), prev.shape[-1])


class CommittedPrefix:
    """The inference loop's side of the forced prefix: the last delivered chunk (bins and frame stamp), the prefix
    a new chunk must force, and the counts. ``enabled`` is the ``force_committed_steps`` parameter; with H = 1
    nothing is ever forced (a single step is replaced, not continued). Not thread-safe: the loop's thread."""

    def __init__(self, enabled: bool = False, horizon: int = 1) -> None:
        self.enabled, self.horizon = bool(enabled), int(horizon)
        self._delivered: Optional[tuple[np.ndarray, int]] = None
        self.forced_chunks = 0  # chunks run with a non-empty forced prefix
        self.forced_steps = 0  # steps forced over all of them

    @property
    def active(self) -> bool:
        return self.enabled and self.horizon > 1

    def forced_bins(self, new_stamp_ns: int, estimate_ms: float, safety_margin_ms: float,
                    step_ns: int, frame_age_ms: float = 0.0) -> Optional[np.ndarray]:
        """The bins to pass as ``run_chunk(forced_bins=...)`` for a frame stamped ``new_stamp_ns``; None when
        inactive, when nothing was delivered, or when the executing chunk commits nothing. ``frame_age_ms``: how
        old the frame already was when it was received (its receive time - its stamp, one clock): the executor
        counts the latency from the stamp, the estimate from the chunk's start."""
        if not self.active or self._delivered is None:
            return None
        bins, stamp = self._delivered
        d = forced_step_count(float(estimate_ms) + max(0.0, float(frame_age_ms)), safety_margin_ms,
                              int(step_ns) / 1e6, self.horizon)
        rows = committed_bins(bins, stamp, new_stamp_ns, step_ns, d)
        return rows if len(rows) else None

    def ran(self, forced: Optional[np.ndarray]) -> None:
        """A chunk completed with ``forced`` as its prefix (None: none): counted."""
        if forced is not None:
            self.forced_chunks += 1
            self.forced_steps += len(forced)

    def delivered(self, result: Any, stamp_ns: int) -> None:
        """A chunk was handed to the action side: it is the executing one from now on."""
        bins = getattr(result, "chunk_bins", None)
        self._delivered = None if bins is None else (np.array(bins, dtype=np.int64), int(stamp_ns))

    def forget(self) -> None:
        """Nothing is executing any more (the action side held: paused, restarted)."""
        self._delivered = None

    def stats(self) -> dict:
        return {"enabled": self.enabled, "forced_chunks": self.forced_chunks, "forced_steps": self.forced_steps}
