"""Camera health over time: recent-window rejection counts and the frozen-camera rule. Pure (no ROS, no I/O).

Why windows: a counter that only grows turns one bad frame into a WARN for the life of the process, which
teaches operators to ignore the camera status. What matters is whether frames are being rejected *now*:
``EventWindow`` keeps the events of the last ``window_s`` seconds, so a status built on it goes back to OK by
itself once the window has no rejection, while ``RejectionCounter`` still keeps the all-time per-reason counts
(nothing is lost, the history stays in the values).

Why the frozen rule looks at time and stamps, not only at a count of repeats: a stuck driver re-publishes one
buffer with fresh stamps, but so does a legitimate re-timing source — ``vla_bag_replay --camera-hz 60``
republishes each 5 Hz bag frame about 12 times, a 1 Hz dataset about 60 times. See ``FrozenDetector``.

Every class takes its clock as an argument (``clock_ns``, monotonic nanoseconds by default) or per call
(``now_ns``), so tests drive time explicitly.
"""
from __future__ import annotations

import statistics
import threading
import time
import zlib
from collections import deque
from typing import Callable, Optional

import numpy as np

DEFAULT_WINDOW_S = 5.0
NS = 1_000_000_000


class EventWindow:
    """Events with a reason code in the last ``window_s`` seconds (count, rate, per reason). Thread-safe.

    One timestamp per event, trimmed on every call: a camera rejecting every frame at 60 Hz keeps 300 entries
    for a 5 s window. ``max_events`` bounds the memory against a flood (the oldest entries go first, so the
    recent count saturates at ``max_events`` rather than growing without limit)."""

    def __init__(self, window_s: float = DEFAULT_WINDOW_S, clock_ns: Callable[[], int] = time.monotonic_ns,
                 max_events: int = 1 << 16) -> None:
        if not window_s > 0.0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = float(window_s)
        self._window_ns = int(window_s * NS)
        self._clock_ns = clock_ns
        self._events: deque[tuple[int, str]] = deque(maxlen=int(max_events))
        self._lock = threading.Lock()
        self.last_ns: Optional[int] = None

    def _now(self, now_ns: Optional[int]) -> int:
        return self._clock_ns() if now_ns is None else int(now_ns)

    def _trim(self, now_ns: int) -> None:
        cutoff = now_ns - self._window_ns
        while self._events and self._events[0][0] <= cutoff:
            self._events.popleft()

    def add(self, reason: str = "", now_ns: Optional[int] = None) -> None:
        now_ns = self._now(now_ns)
        with self._lock:
            self._events.append((now_ns, reason))
            self.last_ns = now_ns
            self._trim(now_ns)

    def count(self, now_ns: Optional[int] = None) -> int:
        now_ns = self._now(now_ns)
        with self._lock:
            self._trim(now_ns)
            return len(self._events)

    def rate_hz(self, now_ns: Optional[int] = None) -> float:
        """Events per second averaged over the whole window."""
        return self.count(now_ns) / self.window_s

    def by_reason(self, now_ns: Optional[int] = None) -> dict[str, int]:
        now_ns = self._now(now_ns)
        with self._lock:
            self._trim(now_ns)
            out: dict[str, int] = {}
            for _, reason in self._events:
                out[reason] = out.get(reason, 0) + 1
            return out

    def last_age_s(self, now_ns: Optional[int] = None) -> Optional[float]:
        """Seconds since the newest event ever added (None before the first)."""
        last = self.last_ns
        return None if last is None else max(0.0, (self._now(now_ns) - last) / NS)


class RejectionCounter:
    """Rejections per reason code: all-time totals, the last message, and the same counts over the recent
    window (``recent_*``: what /diagnostics judges the camera by). Thread-safe."""

    def __init__(self, window_s: float = DEFAULT_WINDOW_S, clock_ns: Callable[[], int] = time.monotonic_ns) -> None:
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.total = 0
        self.last_reason = ""
        self.last_message = ""
        self.recent = EventWindow(window_s, clock_ns)

    def add(self, reason: str, message: str = "", now_ns: Optional[int] = None) -> None:
        with self._lock:
            self.counts[reason] = self.counts.get(reason, 0) + 1
            self.total += 1
            self.last_reason = reason
            self.last_message = message
        self.recent.add(reason, now_ns)

    def count(self, exc, now_ns: Optional[int] = None) -> None:
        """Count an ``image_convert.ImageRejected`` (anything with ``reason`` and ``message``)."""
        self.add(exc.reason, exc.message, now_ns)

    def snapshot(self, now_ns: Optional[int] = None) -> dict:
        with self._lock:
            snap = {"total": self.total, "by_reason": dict(self.counts), "last_reason": self.last_reason,
                    "last_message": self.last_message}
        recent = self.recent.by_reason(now_ns)
        snap.update(recent=sum(recent.values()), recent_by_reason=recent, window_s=self.recent.window_s,
                    recent_rate_hz=sum(recent.values()) / self.recent.window_s,
                    last_age_s=self.recent.last_age_s(now_ns))
        return snap


class FrozenDetector:
    """Flags a frozen camera: the picture stopped changing while frames keep arriving (``limit`` 0 disables).

    Rule, per frame (``update(image, stamp_ns, now_ns)``, ``now_ns`` on the receive clock):
    - a frame with the same content *and* the same non-zero header stamp as the previous one is a duplicate
      (a re-sent message, e.g. a relay or a bag played twice): counted in ``duplicates``, it neither lengthens
      the run of identical frames nor its duration, so re-sending one message never reads as frozen;
    - frozen when the current content has been seen in at least ``limit`` consecutive non-duplicate frames
      (``frozen_frame_limit``: the original rule, unchanged for a live camera) AND has stood still for longer
      than ``hold_factor`` times this source's typical content hold (median of the last ``history`` completed
      holds, capped at ``max_hold_limit_s``).
    Why the second condition: a live sensor's noise changes every frame, so its typical hold is one frame
    period and ``hold_factor`` x that is below ``limit`` periods for any ``limit`` above ``hold_factor`` + 1
    (the default 30 is far above): only the count decides, as before. A re-timing source (bag replay at
    60 Hz of a 5 Hz dataset: each picture repeated ~12 times, for 200 ms) shows its own typical hold (200 ms),
    so it is frozen only when a picture stands still three times as long as the source's pictures usually do,
    whatever the repeat count. (A fixed time such as ``limit`` frame periods at the observed message rate
    would not do: at a steady rate it is the count again, and fires whenever a source repeats each picture
    ``limit`` times or more, e.g. a 1 Hz dataset at 60 Hz.) The factor tolerates a late dataset frame
    (scheduling jitter on a loaded CPU); the cap keeps a source that froze often (long holds in the history)
    from never being called frozen again. Limitation: until the source's content has changed once there is no
    typical hold, so only the count applies (a re-timed first picture repeated ``limit`` times or more is
    flagged until the second picture arrives).

    The content key is crc32 over a strided subsample (up to ~64 full rows, every pixel in them) plus the
    shape: about 0.05 ms for 640x480 instead of hashing 900 KB. A change confined to unsampled rows is missed,
    which only delays detection of a frozen feed (the cost of a false "frozen" is a hold, so we keep it
    unlikely). Fed by one thread; ``snapshot`` may be read from another.
    """

    def __init__(self, limit: int = 30, max_rows: int = 64, hold_factor: float = 3.0, history: int = 16,
                 max_hold_limit_s: float = 10.0, clock_ns: Callable[[], int] = time.monotonic_ns) -> None:
        self.set_limit(limit)
        self.max_rows = max(1, int(max_rows))
        self.hold_factor = float(hold_factor)
        self.max_hold_limit_s = float(max_hold_limit_s)
        self._clock_ns = clock_ns
        self._holds_s: deque[float] = deque(maxlen=max(1, int(history)))
        self._holds_lock = threading.Lock()  # update() on the camera thread, snapshot() on a diagnostics one
        self._last_key: Optional[tuple] = None
        self._last_stamp_ns = 0
        self._run_start_ns = 0  # receive time of the first frame of the current content
        self._run_last_ns = 0  # receive time of the newest non-duplicate frame of it
        self.run_length = 0  # consecutive identical non-duplicate frames including the first of the run
        self.duplicates = 0  # frames that repeated the previous frame's content and header stamp
        self.frozen = False
        self.frozen_events = 0  # transitions into the frozen state

    def set_limit(self, limit: int) -> None:
        if int(limit) < 0:
            raise ValueError(f"frozen_frame_limit must be >= 0, got {limit}")
        self.limit = int(limit)

    def key(self, image: np.ndarray) -> tuple:
        h = image.shape[0]
        stride = max(1, h // self.max_rows)
        sample = image[::stride]
        if sample.ndim == 3 and sample.strides[2] <= 0:
            # Views from image_to_rgb: undo a channel reversal (bgr) or a broadcast (mono) so the sample is
            # gathered from contiguous memory; a fixed transform, so equal frames still give equal keys.
            sample = sample[:, :, :1] if sample.strides[2] == 0 else sample[:, :, ::-1]
        sample = np.ascontiguousarray(sample)
        return (image.shape, str(image.dtype), zlib.crc32(sample))

    def typical_hold_s(self) -> Optional[float]:
        """Median time one picture of this source lasted (None before its content first changed)."""
        with self._holds_lock:
            holds = tuple(self._holds_s)
        return statistics.median(holds) if holds else None

    def hold_limit_s(self) -> float:
        """How long the current picture must stand still (besides ``limit`` frames) to count as frozen."""
        typical = self.typical_hold_s()
        return 0.0 if typical is None else min(self.hold_factor * typical, self.max_hold_limit_s)

    def unchanged_s(self) -> float:
        """How long the current picture has stood still, up to its newest non-duplicate frame."""
        return (self._run_last_ns - self._run_start_ns) / 1e9 if self.run_length else 0.0

    def update(self, image: np.ndarray, stamp_ns: int = 0, now_ns: Optional[int] = None) -> bool:
        """Feed one frame; returns True while the camera is considered frozen."""
        if self.limit == 0:
            self._last_key, self.run_length, self.frozen = None, 0, False
            return False
        now_ns = self._clock_ns() if now_ns is None else int(now_ns)
        k = self.key(image)
        if k == self._last_key:
            if stamp_ns and stamp_ns == self._last_stamp_ns:
                self.duplicates += 1
                return self.frozen
            self.run_length += 1
            self._run_last_ns = now_ns
        else:
            if self._last_key is not None and self.run_length:
                with self._holds_lock:
                    self._holds_s.append(max(0.0, (now_ns - self._run_start_ns) / 1e9))
            self._last_key, self.run_length = k, 1
            self._run_start_ns = self._run_last_ns = now_ns
        self._last_stamp_ns = int(stamp_ns)
        was = self.frozen
        # no typical hold known yet (the source's content never changed): the frame count alone decides
        typical = self.typical_hold_s()
        long_enough = typical is None or self.unchanged_s() > min(self.hold_factor * typical, self.max_hold_limit_s)
        self.frozen = self.run_length >= self.limit and long_enough
        if self.frozen and not was:
            self.frozen_events += 1
        return self.frozen

    def snapshot(self) -> dict:
        typical = self.typical_hold_s()
        return {"frozen": self.frozen, "frozen_events": self.frozen_events, "run_length": self.run_length,
                "unchanged_s": round(self.unchanged_s(), 3), "duplicates": self.duplicates,
                "typical_hold_ms": None if typical is None else round(typical * 1e3, 2),
                "hold_limit_ms": round(self.hold_limit_s() * 1e3, 2)}
