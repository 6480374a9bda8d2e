"""Saliency retention: how many frames tagged salient are still in the KV cache ``k`` frames later.

Time is counted in admitted frames: the frame admitted as the i-th (0-based) has index i. An eviction that
happens while frame j is being admitted, or between the admissions of frames j-1 and j (a budget shrink), is
stamped j. A salient frame with index i is *retained k frames later* when it has not been evicted before the
state right after admitting frame i+k, i.e. its eviction stamp is > i+k (or it was never evicted). It counts
for ``k`` only once frame i+k has been admitted (matured), so the fractions are never biased by the tail of a
run.

Bookkeeping is incremental (a queue per k, O(len(ks)) per admitted frame, memory bounded by the salient
frames of the last max(ks) frames), so ``report()`` stays cheap in an hours-long stream where a noisy camera
may tag many frames salient.
"""
from __future__ import annotations

from collections import deque
from typing import Iterable, Sequence

DEFAULT_KS = (1, 8, 32, 64, 128, 256, 512)


class _Salient:
    __slots__ = ("index", "stamp")

    def __init__(self, index: int):
        self.index = index
        self.stamp: int | None = None  # eviction stamp, None while retained


class SaliencyTracker:
    def __init__(self, ks: Sequence[int] = DEFAULT_KS):
        ks = tuple(ks)
        if not ks or any(not isinstance(k, int) or isinstance(k, bool) or k < 1 for k in ks):
            raise ValueError(f"saliency ks must be positive integers, got {ks!r}")
        self.ks = tuple(sorted(set(ks)))
        self.frames_seen = 0
        self.salient_seen = 0
        self._retained: dict[int, _Salient] = {}  # salient frame id still in the cache -> record
        self._pending: dict[int, deque[_Salient]] = {k: deque() for k in self.ks}  # not yet matured for k
        self._matured = dict.fromkeys(self.ks, 0)
        self._kept = dict.fromkeys(self.ks, 0)

    def on_admit(self, frame_id: int, salient: bool) -> None:
        if salient:
            if frame_id in self._retained:
                raise ValueError(f"salient frame id {frame_id} is already tracked")
            rec = _Salient(self.frames_seen)
            self._retained[frame_id] = rec
            self.salient_seen += 1
            for q in self._pending.values():
                q.append(rec)
        last = self.frames_seen  # index of the frame just admitted
        self.frames_seen += 1
        for k, q in self._pending.items():
            # every eviction stamped <= index + k has happened by now, so the outcome is final
            while q and q[0].index + k <= last:
                rec = q.popleft()
                self._matured[k] += 1
                if rec.stamp is None or rec.stamp > rec.index + k:
                    self._kept[k] += 1

    def on_evict(self, frame_ids: Iterable[int]) -> None:
        """Record evictions stamped with the index of the frame about to be admitted."""
        for f in frame_ids:
            rec = self._retained.pop(f, None)
            if rec is not None:
                rec.stamp = self.frames_seen

    @property
    def salient_retained_now(self) -> int:
        return len(self._retained)

    def retention(self) -> dict[int, dict[str, float | int | None]]:
        """``{k: {"matured": n, "retained": r, "fraction": r/n or None}}`` over the run so far."""
        return {k: {"matured": self._matured[k], "retained": self._kept[k],
                    "fraction": (self._kept[k] / self._matured[k]) if self._matured[k] else None}
                for k in self.ks}

    def report(self) -> dict:
        return {"frames_seen": self.frames_seen, "salient_seen": self.salient_seen,
                "salient_retained_now": self.salient_retained_now,
                "retention": {str(k): v for k, v in self.retention().items()}}
