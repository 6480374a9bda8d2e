"""core/gc_pauses.py: the collector's pauses are counted per generation, and freezing moves objects out of reach."""
from __future__ import annotations

import gc

import pytest

from vla_edge_ros.core.gc_pauses import GcPauseMonitor, freeze_long_lived


def test_monitor_times_each_collection_by_generation():
    ticks = iter(range(0, 10**12, 25_000_000))  # every clock read advances 25 ms: each pause reads as 25 ms
    mon = GcPauseMonitor(slow_ms=10.0, clock_ns=lambda: next(ticks)).install()
    try:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
    finally:
        mon.uninstall()
    snap = mon.snapshot()
    assert snap["collections"][2] >= 2 and snap["collections"][0] >= 1
    assert snap["pause_ms_max"][2] == pytest.approx(25.0)
    assert snap["pauses_over_10ms"][2] == snap["collections"][2]
    assert mon._callback not in gc.callbacks  # uninstalled: no cost left behind
    before = list(mon.count)
    gc.collect()
    assert mon.count == before


def test_a_collection_inside_a_snapshot_does_not_deadlock_it(tmp_path):
    """snapshot() allocates while it holds the monitor's lock, so a collection can start there and its callback
    record in the same thread (seen in CI: a robot process's main loop stuck for good, SIGINT ignored). With every
    allocation a collection (threshold 1), 2000 snapshots finish; the old plain Lock hung on the first ones. In a
    subprocess: a deadlocked monitor stays in gc.callbacks and would stop every later collection of this one."""
    import subprocess
    import sys
    script = tmp_path / "gc_in_snapshot.py"
    script.write_text("import gc\n"
                      "from vla_edge_ros.core.gc_pauses import GcPauseMonitor\n"
                      "m = GcPauseMonitor().install()\n"
                      "gc.set_threshold(1)\n"
                      "for _ in range(2000):\n"
                      "    m.snapshot()\n"
                      "gc.set_threshold(700)\n"
                      "print('collections', sum(m.snapshot()['collections']))\n")
    try:
        p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("snapshot() deadlocked on a collection started inside it")
    assert p.returncode == 0, p.stderr
    assert int(p.stdout.split()[-1]) >= 2000  # collections did run inside the snapshots


def test_short_pauses_are_not_slow_and_bad_threshold_refused():
    mon = GcPauseMonitor(slow_ms=10.0)
    mon.record(2, 3.0)
    mon.record(1, 12.0)
    mon.record(7, 1.0)  # out-of-range generation clamps to the oldest
    snap = mon.snapshot()
    assert snap["collections"] == [0, 1, 2] and snap["pauses_over_10ms"] == [0, 1, 0]
    assert snap["pause_ms_total"][2] == pytest.approx(4.0)
    with pytest.raises(ValueError, match="slow_ms"):
        GcPauseMonitor(slow_ms=0)


def test_freeze_moves_survivors_to_the_permanent_generation():
    keep = [[i] for i in range(1000)]  # tracked containers that survive
    try:
        info = freeze_long_lived()
        assert info["frozen_objects"] >= len(keep) and gc.get_freeze_count() == info["frozen_objects"]
        assert info["collect_ms"] >= 0
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


class _Lifecycle:
    """The inference node's lifecycle as Runtime.bring_up drives it; records the transitions it is asked for."""

    def __init__(self, events: list, configure_ok: bool = True) -> None:
        self.events, self.configure_ok, self.last_error = events, configure_ok, "configure failed"

    def safe_transition(self, name: str) -> bool:
        self.events.append(name)
        return self.configure_ok or name != "configure"

    def get_logger(self):
        return type("Logger", (), {"error": lambda _self, msg: self.events.append("error")})()


def _runtime_with(events: list, configure_ok: bool = True):
    from vla_edge_ros.ros import runtime
    rt = runtime.Runtime.__new__(runtime.Runtime)  # bring_up alone: no ROS context, no nodes
    rt.inference, rt.gc_freeze, rt.active_since = _Lifecycle(events, configure_ok), None, None
    return runtime, rt


def test_bring_up_freezes_between_configure_and_activate(monkeypatch):
    # the collect before the freeze stops every thread: it must come before any chunk or tick is due
    events: list = []
    runtime, rt = _runtime_with(events)
    monkeypatch.setattr(runtime, "freeze_long_lived", lambda: events.append("freeze") or {"frozen_objects": 1})
    monkeypatch.setattr(runtime, "GC_FREEZE", True)
    assert rt.bring_up()
    assert events == ["configure", "freeze", "activate"]
    assert rt.gc_freeze == {"frozen_objects": 1} and rt.active_since is not None


def test_bring_up_does_not_freeze_after_a_failed_configure_or_when_disabled(monkeypatch):
    events: list = []
    runtime, rt = _runtime_with(events, configure_ok=False)
    monkeypatch.setattr(runtime, "freeze_long_lived", lambda: events.append("freeze") or {})
    monkeypatch.setattr(runtime, "GC_FREEZE", True)
    assert not rt.bring_up()
    assert "freeze" not in events and "activate" not in events and rt.gc_freeze is None
    events.clear()
    runtime, rt = _runtime_with(events)
    monkeypatch.setattr(runtime, "GC_FREEZE", False)  # VLA_GC_FREEZE=0
    assert rt.bring_up()
    assert events == ["configure", "activate"] and rt.gc_freeze is None
