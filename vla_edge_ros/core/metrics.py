"""Small, dependency-free runtime figures: latency percentiles, timer period error, event rates, memory.

Each tracker is written by one thread (the one that observes the events) and read by a diagnostics thread;
a short lock guards the ring buffer so a reader never sees a half-updated ring (the lock is held for a few
microseconds, so the writer is never delayed measurably).
"""
from __future__ import annotations

import math
import sys
import threading
import time
from collections import deque
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np


def percentile(samples: Iterable[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default 'linear' method); ``q`` in [0, 100]; NaN when empty."""
    return _sorted_percentile(sorted(samples), q)


def _sorted_percentile(data: Sequence[float], q: float) -> float:
    """``percentile`` of samples already in ascending order (no copy, no sort)."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be within [0, 100], got {q}")
    n = len(data)
    if n == 0:
        return math.nan
    if n == 1:
        return float(data[0])
    pos = (n - 1) * q / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, n - 1)
    frac = pos - lo
    return float(data[lo] + (data[hi] - data[lo]) * frac)


def percentiles(samples: Sequence[float], qs: Sequence[float] = (50.0, 95.0, 99.0)) -> dict[str, float]:
    data = sorted(samples)
    return {f"p{q:g}": _sorted_percentile(data, q) for q in qs}


class LatencyStats:
    """Bounded ring of the most recent samples (ms) plus exact all-time count / max / mean."""

    def __init__(self, capacity: int = 4096) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._ring: deque[float] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self.count = 0
        self.total = 0.0
        self.max = math.nan
        self.last = math.nan

    def add(self, value_ms: float) -> None:
        value_ms = float(value_ms)
        if not math.isfinite(value_ms):
            raise ValueError(f"latency sample must be finite, got {value_ms}")
        with self._lock:
            self._ring.append(value_ms)
            self.count += 1
            self.total += value_ms
            self.last = value_ms
            if not (self.max >= value_ms):  # also true while max is NaN
                self.max = value_ms

    def samples(self) -> list[float]:
        with self._lock:
            return list(self._ring)

    def percentile(self, q: float) -> float:
        return percentile(self.samples(), q)

    @property
    def p50(self) -> float:
        return self.percentile(50.0)

    @property
    def p95(self) -> float:
        return self.percentile(95.0)

    @property
    def p99(self) -> float:
        return self.percentile(99.0)

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else math.nan

    def summary(self) -> dict[str, float]:
        # One consistent snapshot: reading count/max outside the lock let a reader see count > 0 with an
        # empty sample list (NaN percentiles) while a writer was adding the first samples. Only the copy is
        # under the lock and the samples are sorted once: a summary sorting 4096 samples under the lock (and
        # again per percentile) held the writer -- the inference thread -- and the GIL for milliseconds, several
        # times a second (the fleet replay's py-spy --gil profile, session 21).
        # numpy copies and sorts in C: 1.7x faster than list + sort on 4096 samples here, the sort without the GIL
        with self._lock:
            data = np.fromiter(self._ring, dtype=np.float64, count=len(self._ring))
            count, total, max_ = self.count, self.total, self.max
        data.sort()
        return {
            "count": count,
            "p50": _sorted_percentile(data, 50.0),
            "p95": _sorted_percentile(data, 95.0),
            "p99": _sorted_percentile(data, 99.0),
            "mean": total / count if count else math.nan,
            "max": max_,
        }

    def reset(self) -> None:
        with self._lock:
            self._ring.clear()
            self.count = 0
            self.total = 0.0
            self.max = math.nan
            self.last = math.nan


class PeriodTracker:
    """Period error of a periodic callback: |actual interval - nominal|, longest gap, tick count."""

    def __init__(self, nominal_ms: float, capacity: int = 4096) -> None:
        self._check_nominal(nominal_ms)
        self.nominal_ms = float(nominal_ms)
        self._errors = LatencyStats(capacity)
        self._last_ns: Optional[int] = None
        self.ticks = 0
        self.longest_gap_ms = 0.0

    @staticmethod
    def _check_nominal(nominal_ms: float) -> None:
        if not (nominal_ms > 0.0 and math.isfinite(nominal_ms)):
            raise ValueError(f"nominal period must be a positive number of ms, got {nominal_ms}")

    def set_nominal_ms(self, nominal_ms: float) -> None:
        """Live period change: the interval spanning the change is not judged against either period."""
        self._check_nominal(nominal_ms)
        self.nominal_ms = float(nominal_ms)
        self._last_ns = None

    def tick(self, now_ns: Optional[int] = None) -> Optional[float]:
        """Record one tick; returns this interval's period error in ms (None for the first tick)."""
        now_ns = time.monotonic_ns() if now_ns is None else int(now_ns)
        self.ticks += 1
        last, self._last_ns = self._last_ns, now_ns
        if last is None:
            return None
        gap_ms = (now_ns - last) / 1e6
        if gap_ms > self.longest_gap_ms:
            self.longest_gap_ms = gap_ms
        err = abs(gap_ms - self.nominal_ms)
        self._errors.add(err)
        return err

    @property
    def error_stats(self) -> LatencyStats:
        return self._errors

    def summary(self) -> dict[str, float]:
        data = sorted(self._errors.samples())
        return {
            "ticks": self.ticks,
            "nominal_ms": self.nominal_ms,
            "period_error_p50_ms": percentile(data, 50.0),
            "period_error_p99_ms": percentile(data, 99.0),
            "period_error_max_ms": self._errors.max,
            "longest_gap_ms": self.longest_gap_ms,
        }


class RateCounter:
    """Events per second over a sliding window of ``window_s`` seconds, plus an all-time total."""

    def __init__(self, window_s: float = 1.0) -> None:
        if not (window_s > 0.0 and math.isfinite(window_s)):
            raise ValueError(f"window_s must be positive, got {window_s}")
        self.window_ns = int(window_s * 1e9)
        self._stamps: deque[int] = deque()
        self._lock = threading.Lock()
        self.total = 0

    def _trim(self, now_ns: int) -> None:
        cutoff = now_ns - self.window_ns
        while self._stamps and self._stamps[0] <= cutoff:
            self._stamps.popleft()

    def add(self, now_ns: Optional[int] = None, n: int = 1) -> None:
        now_ns = time.monotonic_ns() if now_ns is None else int(now_ns)
        with self._lock:
            self.total += n
            self._stamps.extend([now_ns] * n)
            self._trim(now_ns)

    def rate(self, now_ns: Optional[int] = None) -> float:
        now_ns = time.monotonic_ns() if now_ns is None else int(now_ns)
        with self._lock:
            self._trim(now_ns)
            return len(self._stamps) / (self.window_ns / 1e9)


# ---- memory -----------------------------------------------------------------------------------------------
def _proc_status_kb(field: str) -> Optional[float]:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return float(line.split()[1])
    except OSError:
        return None
    return None


def current_rss_mb() -> float:
    """Resident set size of this process now, in MiB (psutil, else /proc, else NaN)."""
    try:
        import psutil  # optional

        return psutil.Process().memory_info().rss / (1024.0 * 1024.0)
    except Exception:  # psutil missing or unsupported platform
        pass
    kb = _proc_status_kb("VmRSS")
    return kb / 1024.0 if kb is not None else math.nan


def peak_rss_mb() -> float:
    """Peak resident set size of this process, in MiB (/proc VmHWM, else getrusage)."""
    kb = _proc_status_kb("VmHWM")
    if kb is not None:
        return kb / 1024.0
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        # Linux reports KiB, macOS bytes.
        return peak / (1024.0 * 1024.0) if sys.platform == "darwin" else peak / 1024.0
    except Exception:
        return math.nan


class CumulativeHistogram:
    """Counts of samples (ms) in geometric buckets since start: bucket b holds (upper(b - 1), upper(b)], upper(b) =
    ``MIN_MS`` * 2 ** (b / ``PER_OCTAVE``), i.e. 2.2 % wide. Why: a long run's figures over one window (the
    replay measures from the moment every camera's frames arrive) are the difference of two snapshots, which a
    ring of recent samples cannot give. One writer, any reader."""
    MIN_MS = 0.01
    PER_OCTAVE = 32

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}
        self._lock = threading.Lock()

    @classmethod
    def bucket(cls, ms: float) -> int:
        return 0 if not ms > cls.MIN_MS else math.ceil(cls.PER_OCTAVE * math.log2(ms / cls.MIN_MS))

    @classmethod
    def upper_ms(cls, bucket: int) -> float:
        return cls.MIN_MS * 2.0 ** (int(bucket) / cls.PER_OCTAVE)

    def add(self, ms: float) -> None:
        b = self.bucket(float(ms))
        with self._lock:
            self._counts[b] = self._counts.get(b, 0) + 1

    def snapshot(self) -> dict[str, int]:
        """{bucket: count} (JSON keys are strings)."""
        with self._lock:
            return {str(b): n for b, n in sorted(self._counts.items())}


def window_percentiles(end: Optional[Mapping], start: Optional[Mapping] = None,
                       qs: tuple[float, ...] = (50.0, 99.0)) -> dict[str, Any]:
    """Percentiles (nearest rank) of the samples added between two ``CumulativeHistogram.snapshot``s: each is
    its bucket's upper edge, so never below the true value and less than 2.2 % above it. ``count`` samples;
    None figures when the window holds none."""
    counts = {int(b): int(n) - int((start or {}).get(b, 0) or 0) for b, n in (end or {}).items()}
    counts = {b: n for b, n in sorted(counts.items()) if n > 0}
    total = sum(counts.values())
    out: dict[str, Any] = {"count": total}
    for q in qs:
        rank, seen, value = max(1, math.ceil(q / 100.0 * total)), 0, None
        for b, n in counts.items():
            seen += n
            if seen >= rank:
                value = CumulativeHistogram.upper_ms(b)
                break
        out[f"p{q:g}"] = value if total else None
    out["max"] = CumulativeHistogram.upper_ms(max(counts)) if counts else None
    return out
