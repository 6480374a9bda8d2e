"""Garbage-collector pauses: measured, and kept out of the control loop's way.

CPython's cyclic collector stops every thread of the process while it runs. A young-generation pass costs
microseconds, but a full (generation 2) pass walks every tracked container object the process holds -- rclpy,
numpy, the message classes, the engine -- and in role ``all`` the 30 Hz action timer waits it out. The 30-minute
soak on the 2-core machine saw one such stall: one missed tick, an 85 ms gap between two ticks.

Two things here:

- :func:`freeze_long_lived` (``gc.collect()`` then ``gc.freeze()``) once start-up is over: everything allocated
  so far (modules, nodes, the engine, its weights' wrappers) moves to the permanent generation, which later full
  passes skip, so a full pass costs only what was allocated since.
- :class:`GcPauseMonitor` times every collection through ``gc.callbacks`` and keeps, per generation, the count,
  the longest pause and how many exceeded a threshold: the figure that says whether a late tick was the
  collector's. The callbacks cost two ``perf_counter_ns`` calls per collection.
"""
from __future__ import annotations

import gc
import threading
import time
from typing import Optional

SLOW_PAUSE_MS = 10.0  # a pause this long is a third of a 30 Hz period


_frozen_objects = 0  # gc.get_freeze_count() after the last freeze_long_lived (see GcPauseMonitor.snapshot)


def freeze_long_lived() -> dict:
    """Collect once, then move every surviving object to the permanent generation; returns the counts."""
    global _frozen_objects
    t0 = time.perf_counter_ns()
    collected = gc.collect()
    gc.freeze()
    _frozen_objects = gc.get_freeze_count()
    return {"collected": collected, "frozen_objects": _frozen_objects,
            "collect_ms": (time.perf_counter_ns() - t0) / 1e6}


class GcPauseMonitor:
    """Per-generation collection counts and pause durations (``gc.callbacks``); install once, uninstall on close."""

    def __init__(self, slow_ms: float = SLOW_PAUSE_MS, clock_ns=time.perf_counter_ns) -> None:
        if not slow_ms > 0:
            raise ValueError(f"slow_ms must be > 0, got {slow_ms}")
        self.slow_ms = float(slow_ms)
        self._clock_ns = clock_ns
        # Re-entrant: a collection can start inside snapshot() (its dicts and lists are allocations), and the
        # callback then records in the same thread that holds the lock. A plain Lock deadlocked that thread for
        # good (CI, session 34: a robot process's main loop stopped writing stats and ignored SIGINT; its GC
        # stayed off). Another thread's callback just waits for the snapshot to finish.
        self._lock = threading.RLock()
        self._started: Optional[int] = None
        self.count = [0, 0, 0]
        self.slow = [0, 0, 0]
        self.max_ms = [0.0, 0.0, 0.0]
        self.total_ms = [0.0, 0.0, 0.0]
        self._installed = False

    def install(self) -> "GcPauseMonitor":
        if not self._installed:
            gc.callbacks.append(self._callback)
            self._installed = True
        return self

    def uninstall(self) -> None:
        if self._installed:
            try:
                gc.callbacks.remove(self._callback)
            except ValueError:
                pass
            self._installed = False

    def _callback(self, phase: str, info: dict) -> None:
        # Runs inside the collector, with the world stopped: no allocation-heavy work, no logging.
        if phase == "start":
            self._started = self._clock_ns()
            return
        if self._started is None:
            return
        ms = (self._clock_ns() - self._started) / 1e6
        self._started = None
        self.record(int(info.get("generation", 0)), ms)

    def record(self, generation: int, ms: float) -> None:
        g = min(max(int(generation), 0), 2)
        with self._lock:
            self.count[g] += 1
            self.total_ms[g] += ms
            if ms > self.max_ms[g]:
                self.max_ms[g] = ms
            if ms >= self.slow_ms:
                self.slow[g] += 1

    def snapshot(self) -> dict:
        with self._lock:
            return {"collections": list(self.count), "pause_ms_max": [round(v, 3) for v in self.max_ms],
                    "pause_ms_total": [round(v, 3) for v in self.total_ms],
                    f"pauses_over_{self.slow_ms:g}ms": list(self.slow),
                    # counted when frozen, not here: gc.get_freeze_count() walks the whole permanent generation
                    # (55 000 objects on the fleet edge: 38 % of its main thread's GIL holds, py-spy, session 22)
                    "frozen_objects": _frozen_objects}
