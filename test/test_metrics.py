"""metrics: percentile, LatencyStats ring, PeriodTracker, RateCounter, RSS helpers."""
import builtins
import math
import mmap
import threading

import numpy as np
import pytest

from vla_edge_ros.core import metrics
from vla_edge_ros.core.metrics import LatencyStats, PeriodTracker, RateCounter, percentile

MS = 1_000_000


def test_percentile_matches_numpy_linear():
    rng = np.random.default_rng(3)
    for n in (1, 2, 3, 10, 101, 1000):
        data = rng.exponential(5.0, size=n).tolist()
        for q in (0, 1, 50, 95, 99, 100):
            assert percentile(data, q) == pytest.approx(float(np.percentile(data, q)))
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_latency_stats_ring_is_bounded_but_count_is_exact():
    st = LatencyStats(capacity=10)
    for v in range(1, 26):
        st.add(float(v))
    assert st.count == 25
    assert st.samples() == [float(v) for v in range(16, 26)]
    assert st.p50 == pytest.approx(20.5)
    assert st.p99 == pytest.approx(float(np.percentile(range(16, 26), 99)))
    assert st.max == 25.0 and st.last == 25.0
    assert st.mean == pytest.approx(13.0)  # all-time mean, not just the ring
    s = st.summary()
    assert s["count"] == 25 and s["p95"] == pytest.approx(float(np.percentile(range(16, 26), 95)))
    with pytest.raises(ValueError):
        st.add(math.nan)
    assert st.count == 25
    st.reset()
    assert st.count == 0 and math.isnan(st.p50) and math.isnan(st.max)
    with pytest.raises(ValueError):
        LatencyStats(capacity=0)


def test_latency_stats_reader_during_writes():
    st = LatencyStats(capacity=100)
    stop = threading.Event()
    bad = []

    def reader():
        while not stop.is_set():
            s = st.summary()
            if s["count"] and not (s["p50"] <= s["p99"] <= s["max"]):
                bad.append(s)

    t = threading.Thread(target=reader)
    t.start()
    for i in range(20000):
        st.add(float(i % 97))
    stop.set()
    t.join(30)
    assert not bad and st.count == 20000


def test_period_tracker_errors_and_longest_gap():
    pt = PeriodTracker(nominal_ms=10.0)
    assert pt.tick(0) is None
    intervals = [10, 11, 9, 10, 25, 10]
    t = 0
    errs = []
    for iv in intervals:
        t += iv * MS
        errs.append(pt.tick(t))
    assert errs == pytest.approx([0, 1, 1, 0, 15, 0])
    s = pt.summary()
    assert s["ticks"] == 7
    assert s["longest_gap_ms"] == pytest.approx(25.0)
    assert s["period_error_p50_ms"] == pytest.approx(float(np.percentile([0, 1, 1, 0, 15, 0], 50)))
    assert s["period_error_p99_ms"] == pytest.approx(float(np.percentile([0, 1, 1, 0, 15, 0], 99)))
    assert s["period_error_max_ms"] == pytest.approx(15.0)
    pt.set_nominal_ms(20.0)
    assert pt.tick(t + 500 * MS) is None  # the interval spanning a period change is not judged
    assert pt.tick(t + 520 * MS) == pytest.approx(0.0)
    with pytest.raises(ValueError):
        PeriodTracker(0.0)


def test_rate_counter_window():
    rc = RateCounter(window_s=1.0)
    for i in range(30):
        rc.add(now_ns=i * 33 * MS)
    assert rc.rate(now_ns=29 * 33 * MS) == pytest.approx(30.0)
    assert rc.rate(now_ns=29 * 33 * MS + 500 * MS) == pytest.approx(16.0)  # stamps 462..957 ms
    assert rc.rate(now_ns=10_000 * MS) == 0.0
    assert rc.total == 30
    rc.add(now_ns=10_000 * MS, n=5)
    assert rc.rate(now_ns=10_000 * MS) == 5.0 and rc.total == 35
    with pytest.raises(ValueError):
        RateCounter(0)


def test_rss_grows_with_an_allocation():
    before = metrics.current_rss_mb()
    assert before > 1.0 and math.isfinite(before)
    # An anonymous mapping of its own, every page written: new resident pages for certain. (np.ones of 64 MiB
    # once reused memory the allocator had kept resident from an earlier test, so RSS did not move in CI.)
    size = 64 * 1024 * 1024
    block = mmap.mmap(-1, size)
    page = mmap.PAGESIZE
    for offset in range(0, size, page):
        block[offset] = 1
    after = metrics.current_rss_mb()
    assert after - before > 40.0
    assert metrics.peak_rss_mb() >= after - 1.0
    block.close()


def test_rss_without_psutil_uses_proc(monkeypatch):
    with_psutil = metrics.current_rss_mb()
    real_import = builtins.__import__

    def no_psutil(name, *a, **k):
        if name == "psutil":
            raise ImportError("psutil hidden by the test")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_psutil)
    without = metrics.current_rss_mb()
    assert without == pytest.approx(with_psutil, rel=0.2)
