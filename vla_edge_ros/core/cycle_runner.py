"""The fleet loop's thread: one pass-serving call per cycle of a CycleClock, pause / resume, a clean stop, and a
way for the process's other threads to find the gap between two passes. No ROS, no engine.

Why apart: the fleet loop (core/fleet_loop.py) says what a cycle does; this says when it runs and how the
threads around it meet it, which is a separate thing to hold in mind and to test.

- ``serve(now_ns)`` runs at most once per cycle index: after it the thread sleeps to the next cycle boundary
  (``CycleClock.next_deadline``), so a pass that overran its cycle is followed by the next boundary, not by a
  burst of catch-up passes.
- Paused, the thread calls ``while_paused()`` every ``wait_timeout_s`` (the fleet applies robot joins / leaves
  then) and serves nothing; ``stop`` wakes it.
- An exception outside ``serve``'s own handling goes to ``on_error(exc)`` and the thread backs off one period
  and goes on: a bug must not end the robots' actions silently.
- ``wait_between_passes``: the stats and /diagnostics threads' housekeeping waits for the gap after a pass
  (every GIL hand-back of a pass waits for whichever thread holds the GIL; docs/FIGURES.md measured that work
  landing inside passes as the fleet's host tail).

``LoopThreadState`` (stop events, stop-and-join, running / paused) is shared with core/inference_loop.py, whose
thread waits for frames and for a chunk to be due rather than for cycle boundaries.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from vla_edge_ros.core.admission import CycleClock


class LoopThreadState:
    """A loop thread's stop / pause state and its stop-and-join: CycleRunner's and InferenceLoop's."""

    def _init_loop_thread_state(self) -> None:
        self._stop, self._resumed = threading.Event(), threading.Event()
        self._resumed.set()
        self._thread: Optional[threading.Thread] = None

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop and join; False when the thread is still inside a (hung) pass or chunk after ``timeout_s``."""
        self._stop.set()
        self._resumed.set()  # wake a paused thread so it sees the stop
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                return False
            self._thread = None
        return True

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()


class CycleRunner(LoopThreadState):
    def __init__(self, clock: CycleClock, serve: Callable[[int], None], *,
                 while_paused: Callable[[], None] = lambda: None,
                 on_error: Callable[[Exception], None] = lambda exc: None,
                 on_event: Callable[[str], None] = lambda kind: None,
                 clock_ns: Callable[[], int] = time.monotonic_ns, wait_timeout_s: float = 0.1,
                 thread_name: str = "vla_cycle_runner") -> None:
        self.clock, self.serve, self.while_paused = clock, serve, while_paused
        self.on_error, self.on_event = on_error, on_event
        self._clock_ns, self.wait_timeout_s, self.thread_name = clock_ns, wait_timeout_s, thread_name
        self._init_loop_thread_state()
        self._between_passes = threading.Event()  # set while the thread sleeps to the next cycle boundary
        self._served_cycle = -1  # the cycle index the thread served last
        self.thread_cpu_s = 0.0  # CPU time of the thread so far (updated after every served cycle)

    def _run(self) -> None:
        self.on_event("started")
        served: Optional[int] = None
        while not self._stop.is_set():
            try:
                if not self._resumed.is_set():
                    self.while_paused()
                    self._resumed.wait(self.wait_timeout_s)
                    continue
                now = self._clock_ns()
                index = self.clock.cycle_index(now)
                if served is not None and index <= served:  # this cycle is served: sleep to the next boundary
                    self._between_passes.set()
                    self._stop.wait(max(0.0, (self.clock.next_deadline(now) - now) / 1e9))
                    continue
                served = self._served_cycle = index
                self._between_passes.clear()
                self.serve(now)
                self.thread_cpu_s = time.thread_time()
            except Exception as exc:  # a bug outside the pass: report, back off one period, keep going
                self.on_error(exc)
                self._stop.wait(self.clock.period_ms / 1e3)
        self.on_event("stopped")

    def wait_between_passes(self, timeout_s: float, min_gap_ms: float = 8.0) -> bool:
        """Block until the thread sleeps between passes with at least ``min_gap_ms`` to the next cycle boundary,
        at most ``timeout_s``. True when such a gap was found (or the thread is not serving: nothing to wait
        for), False on timeout. Best effort: a pass may still start while the caller works."""
        end = time.monotonic() + max(0.0, timeout_s)
        while True:
            if not self.running or self.paused:
                return True
            now = self._clock_ns()
            between = self._between_passes.is_set()
            if (between and self.clock.cycle_index(now) == self._served_cycle
                    and (self.clock.next_deadline(now) - now) / 1e6 >= min_gap_ms):
                return True
            left = end - time.monotonic()
            if left <= 0:
                return False
            if between:  # the gap left is too short: the next pass starts within it
                time.sleep(min(left, 0.001))
            else:  # a pass runs: its end sets the event
                self._between_passes.wait(left)

    def start(self) -> None:
        if self.running:
            raise RuntimeError(f"{self.thread_name} already running")
        self._stop.clear()
        self.clock.set_period_ms(self.clock.period_ms, start_ns=self._clock_ns())
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def pause(self) -> None:
        """Serve no more cycles (the one in progress completes)."""
        self._resumed.clear()

    def resume(self) -> None:
        self._resumed.set()

