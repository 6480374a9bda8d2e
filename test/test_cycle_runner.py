"""CycleRunner (core/cycle_runner.py): at most one serve per cycle, no catch-up burst after an overrun, errors
reported and survived, pause / resume / stop. Real threads with 10 ms cycles; bounds on counts, not on timing."""
import threading
import time

import pytest

from vla_edge_ros.core.admission import CycleClock
from vla_edge_ros.core.cycle_runner import CycleRunner


def runner(serve, **kw) -> CycleRunner:
    return CycleRunner(CycleClock(10.0), serve, wait_timeout_s=0.01, thread_name="test_runner", **kw)


def test_each_cycle_is_served_at_most_once_and_an_overrun_is_not_caught_up():
    clock = CycleClock(10.0)
    served: list[int] = []

    def serve(now_ns):
        served.append(clock.cycle_index(now_ns))
        if len(served) == 3:
            time.sleep(0.055)  # overruns five cycles

    r = CycleRunner(clock, serve, wait_timeout_s=0.01)
    r.start()
    time.sleep(0.25)
    assert r.stop()
    assert len(served) >= 5 and served == sorted(set(served))  # strictly increasing: never twice a cycle
    gap = served[3] - served[2]
    assert gap >= 5  # after the overrun it served the cycle it woke in, not the five it missed
    assert len(served) <= 25 - 4 + 2  # 25 cycles in 0.25 s, minus the overrun's
    assert r.thread_cpu_s > 0.0 and not r.running


def test_an_error_is_reported_and_the_thread_goes_on():
    errors, calls = [], []

    def serve(now_ns):
        calls.append(now_ns)
        if len(calls) == 2:
            raise RuntimeError("boom")

    r = runner(serve, on_error=errors.append)
    r.start()
    time.sleep(0.15)
    assert r.stop()
    assert [str(e) for e in errors] == ["boom"] and len(calls) >= 4


def test_paused_serves_nothing_and_calls_while_paused_and_stop_wakes_it():
    calls, idle, events = [], [], []
    r = runner(lambda now: calls.append(now), while_paused=lambda: idle.append(1), on_event=events.append)
    r.pause()
    r.start()
    time.sleep(0.08)
    assert calls == [] and len(idle) >= 3 and r.paused
    assert r.wait_between_passes(0.0)  # paused: nothing to wait for
    r.resume()
    time.sleep(0.08)
    assert len(calls) >= 3
    r.pause()
    t0 = time.monotonic()
    assert r.stop(timeout_s=1.0) and time.monotonic() - t0 < 0.5
    assert events == ["started", "stopped"]


def test_start_twice_is_refused_and_a_hung_serve_is_reported_by_stop():
    entered, release = threading.Event(), threading.Event()
    r = runner(lambda now: entered.set() or release.wait(5.0))
    r.start()
    try:
        with pytest.raises(RuntimeError, match="already running"):
            r.start()
        assert entered.wait(5.0)
        assert r.stop(timeout_s=0.05) is False  # still inside serve
    finally:
        release.set()
    assert r.stop(timeout_s=5.0)
