"""PassProfile: per-pass stages (wall, the thread's CPU, run queue), histograms and the slowest passes per time
bucket; a window from two snapshots. Fake clocks."""
import json

import pytest

from vla_edge_ros.core.pass_profile import STAGES, PassProfile, describe, thread_runq_ns, window

MS = 1_000_000


class Clock:
    def __init__(self):
        self.t = 0

    def __call__(self):
        return self.t


def profile(**kw):
    wall, cpu = Clock(), Clock()
    kw.setdefault("runq_ns", lambda: None)
    return PassProfile(clock_ns=wall, cpu_ns=cpu, **kw), wall, cpu


def run_pass(p, wall, cpu, steps, host_ms, size=1, timing=None, cycle_ms=0.0):
    """``steps``: [(stage, wall ms, cpu ms)] after the wake stage (``cycle_ms`` after the cycle began)."""
    start = wall.t
    wall.t += int(cycle_ms * MS)
    p.begin(start, wall.t)
    for stage, w_ms, c_ms in steps:
        wall.t += int(w_ms * MS)
        cpu.t += int(c_ms * MS)
        p.mark(stage)
    return p.end(size, host_ms, timing)


def test_each_stage_has_its_wall_and_cpu_time_and_the_engine_split():
    p, wall, cpu = profile()
    rec = run_pass(p, wall, cpu, [("plan", 0.5, 0.4), ("encode", 9.0, 1.0), ("engine", 20.0, 2.0),
                                  ("deliver", 1.0, 1.0)], host_ms=12.0, size=3, cycle_ms=2.0,
                   timing={"prefill_ms": 3.0, "decode_ms": 14.0, "launch_ms": 1.5, "sync_ms": "bad"})
    assert rec["size"] == 3 and rec["host_ms"] == 12.0
    assert rec["stages"]["wake"] == {"wall_ms": 2.0}  # no CPU figure before the loop woke
    assert rec["stages"]["encode"] == {"wall_ms": pytest.approx(9.0), "cpu_ms": pytest.approx(1.0)}
    assert rec["stages"]["engine"]["wall_ms"] == pytest.approx(20.0)
    assert rec["engine"] == {"prefill_ms": 3.0, "decode_ms": 14.0, "launch_ms": 1.5}  # malformed sync_ms left out
    json.dumps(p.snapshot())


def test_a_window_has_the_stage_percentiles_and_its_own_slowest_passes():
    p, wall, cpu = profile(keep=2, bucket_s=0.001)  # a bucket per pass here
    run_pass(p, wall, cpu, [("plan", 0.1, 0.1), ("encode", 500.0, 1.0)], host_ms=500.0)  # start-up, before
    start = p.snapshot()
    for k in range(10):
        run_pass(p, wall, cpu, [("plan", 0.1, 0.1), ("encode", 1.0 + k, 1.0)], host_ms=float(k))
    end = p.snapshot()
    assert end["passes"] == 11
    w = window(end, start, keep=2)
    assert w["passes"] == 10
    assert [r["host_ms"] for r in w["slowest"]] == [9.0, 8.0]  # the 500 ms pass began before the window
    enc = w["stages"]["encode"]
    assert 10.0 <= enc["wall_ms"]["max"] < 10.3 and 1.0 <= enc["cpu_ms"]["p50"] < 1.03  # bucket upper edges
    assert 5.0 <= enc["wall_ms"]["p50"] < 6.2
    assert "engine" not in w["stages"]  # never marked
    assert window(end)["passes"] == 11 and window(end)["slowest"][0]["host_ms"] == 500.0


def test_slowest_are_kept_per_time_bucket_and_old_buckets_fall_out():
    p, wall, cpu = profile(keep=1, bucket_s=1.0, buckets=3)
    for k in range(5):  # one pass per second, the oldest the slowest
        wall.t = k * 1000 * MS
        run_pass(p, wall, cpu, [("plan", 1.0, 1.0)], host_ms=100.0 - k)
    s = p.snapshot()
    assert s["passes"] == 5
    assert [r["host_ms"] for r in s["slowest"]] == [98.0, 97.0, 96.0]  # buckets 2..4 kept
    wall.t = 4 * 1000 * MS + 500 * MS
    run_pass(p, wall, cpu, [("plan", 1.0, 1.0)], host_ms=99.0)  # a slower one in the same bucket replaces it
    assert [r["host_ms"] for r in p.snapshot()["slowest"]] == [99.0, 98.0, 97.0]


def test_discard_unbegun_and_unknown_stage():
    p, wall, cpu = profile()
    assert p.end(1, 1.0) is None  # never begun
    p.begin(0, 0)
    p.mark("plan")
    p.discard()
    assert p.end(1, 1.0) is None and p.snapshot()["passes"] == 0
    with pytest.raises(ValueError, match="unknown stage"):
        p.mark("wake")
    with pytest.raises(ValueError):
        PassProfile(keep=0)


def test_describe_names_every_stage_and_the_slowest_pass():
    p, wall, cpu = profile()
    run_pass(p, wall, cpu, [(s, 2.0, 1.0) for s in STAGES[1:]], host_ms=30.5, size=2, timing={"sync_ms": 16.0})
    lines = describe(window(p.snapshot()))
    assert all(s in lines[0] for s in STAGES) and "sync" in lines[0]
    assert "host 30.5 ms" in lines[1] and "2 robot(s)" in lines[1] and "encode 2.0/1.0" in lines[1]
    assert describe({"passes": 0}) == ["- pass stages: no pass in the window"]


def test_run_queue_time_per_stage_where_the_kernel_gives_it():
    """A stage that waited for a core shows it as run-queue time (schedstat); none before the loop woke."""
    runq = Clock()
    p, wall, cpu = profile(runq_ns=runq)
    p.begin(0, 0)
    wall.t += 50 * MS
    cpu.t += 2 * MS
    runq.t += 45 * MS  # runnable, no core: the machine (or its CPU quota) was full
    p.mark("encode")
    rec = p.end(1, 50.0)
    assert rec["stages"]["encode"] == {"wall_ms": 50.0, "cpu_ms": 2.0, "runq_ms": 45.0}
    assert "runq_ms" not in rec["stages"]["wake"]
    lines = describe(window(p.snapshot()))
    assert "encode 50.0/2.0/45.0" in lines[1] and "runq 45." in lines[0]
    got = thread_runq_ns()
    assert got is None or got >= 0  # Linux: this thread's own figure


def test_the_schedstat_file_of_a_thread_is_closed_when_the_thread_ends():
    """thread_runq_ns keeps one descriptor per thread: a loop thread started again and again (lifecycle) must not
    leave one behind each time."""
    import gc
    import os
    import sys
    import threading

    from vla_edge_ros.core.pass_profile import thread_runq_ns

    if not sys.platform.startswith("linux") or thread_runq_ns() is None:
        pytest.skip("no readable /proc/thread-self/schedstat")
    before = len(os.listdir("/proc/self/fd"))
    got = []
    for _ in range(20):
        th = threading.Thread(target=lambda: got.append((thread_runq_ns(), len(os.listdir("/proc/self/fd")))))
        th.start()
        th.join()
    gc.collect()
    assert len(got) == 20 and all(v is not None for v, _ in got)
    assert max(n for _, n in got) > before  # each thread had its own file open while it ran
    assert len(os.listdir("/proc/self/fd")) <= before  # and none is left
