"""core.camera_health with an injected clock: the recent-window counts that clear by themselves, and the
frozen rule (content against time, header stamps for re-sent messages), including the bag-replay case of
issue 19: a 5 Hz dataset republished at 60 Hz by ``vla_bag_replay --camera-hz 60`` (each picture ~12 times)."""
import numpy as np
import pytest

from vla_edge_ros.core.camera_health import EventWindow, FrozenDetector, RejectionCounter

S = 1_000_000_000
MS = 1_000_000


class FakeClock:
    def __init__(self, t_ns: int = 1000 * S) -> None:
        self.t_ns = t_ns

    def __call__(self) -> int:
        return self.t_ns

    def advance_s(self, s: float) -> None:
        self.t_ns += int(s * S)


# ---- recent window ------------------------------------------------------------------------------------------
def test_event_window_counts_only_the_last_window_and_empties_by_itself():
    clock = FakeClock()
    w = EventWindow(5.0, clock)
    assert w.count() == 0 and w.rate_hz() == 0.0 and w.last_age_s() is None
    for _ in range(10):
        w.add("short_data")
        clock.advance_s(0.1)
    w.add("bad_stamp")
    assert w.count() == 11 and w.by_reason() == {"short_data": 10, "bad_stamp": 1}
    assert w.rate_hz() == pytest.approx(11 / 5.0)
    clock.advance_s(4.5)  # the first events are now 5.5 s old, the last 4.5 s
    assert w.count() == 5 and w.by_reason() == {"short_data": 4, "bad_stamp": 1}
    clock.advance_s(0.6)
    assert w.count() == 0 and w.by_reason() == {} and w.rate_hz() == 0.0
    assert w.last_age_s() == pytest.approx(5.1)  # the age of the newest event is still known


def test_event_window_explicit_times_and_bounds():
    w = EventWindow(1.0, clock_ns=lambda: 0, max_events=3)
    for t in range(5):
        w.add("x", now_ns=t * 100 * MS)
    assert w.count(now_ns=500 * MS) == 3  # bounded: the oldest went first
    assert w.count(now_ns=1350 * MS) == 1  # 400 ms kept; 300 ms is out of the window
    with pytest.raises(ValueError):
        EventWindow(0.0)


def test_rejection_counter_warn_window_clears_but_cumulative_counts_stay():
    clock = FakeClock()
    rc = RejectionCounter(window_s=5.0, clock_ns=clock)
    for _ in range(3):
        rc.add("unknown_encoding", "encoding 'nv12' ...")
    snap = rc.snapshot()
    assert (snap["recent"], snap["total"], snap["recent_rate_hz"]) == (3, 3, pytest.approx(0.6))
    clock.advance_s(5.01)
    snap = rc.snapshot()
    assert snap["recent"] == 0 and snap["recent_by_reason"] == {} and snap["recent_rate_hz"] == 0.0
    assert snap["total"] == 3 and snap["by_reason"] == {"unknown_encoding": 3}  # history kept
    assert snap["last_message"].startswith("encoding") and snap["last_age_s"] == pytest.approx(5.01)
    rc.add("short_data")
    assert rc.snapshot()["recent_by_reason"] == {"short_data": 1}


# ---- frozen rule --------------------------------------------------------------------------------------------
def pictures(n, shape=(48, 64, 3), seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, shape, dtype=np.uint8) for _ in range(n)]


def feed(fd, frames, period_ns, t0_ns=0, stamps=None):
    """Feed frames at a fixed receive period; returns the frozen flag after each."""
    out = []
    for i, img in enumerate(frames):
        stamp = t0_ns + i * period_ns + 1 if stamps is None else stamps[i]
        out.append(fd.update(img, stamp_ns=stamp, now_ns=t0_ns + i * period_ns))
    return out


def test_live_camera_that_freezes_is_flagged_after_the_frame_limit():
    fd = FrozenDetector(limit=30)
    live = pictures(60)
    period = 33 * MS
    assert not any(feed(fd, live, period))
    frozen = feed(fd, [live[-1]] * 40, period, t0_ns=60 * period)
    # the last live picture is frame 1 of the run: 29 more copies make 30 identical frames
    assert frozen.index(True) == 28 and all(frozen[28:])
    assert fd.frozen_events == 1
    assert fd.snapshot()["typical_hold_ms"] == pytest.approx(33.0)


def test_bag_replay_retimed_to_60hz_is_not_frozen():
    """5 Hz content, each picture repeated 12 times at 60 Hz with fresh stamps (bag_replay._camera_tick).
    With frozen_frame_limit 10 a count of repeats alone would call every picture frozen (12 >= 10)."""
    fd = FrozenDetector(limit=10)
    period = 1_000_000_000 // 60
    bag = pictures(40)
    stream = [img for img in bag for _ in range(12)]
    flags, longest_run = [], 0
    for i, img in enumerate(stream):
        flags.append(fd.update(img, stamp_ns=i * period + 1, now_ns=i * period))
        longest_run = max(longest_run, fd.run_length)
    assert longest_run == 12 >= fd.limit  # so a count of repeats alone would fire on every picture
    first_change = 12
    assert not any(flags[first_change:]), flags.index(True, first_change)
    assert fd.frozen_events <= 1  # at most the very first picture (no typical hold known yet: documented)
    assert fd.snapshot()["typical_hold_ms"] == pytest.approx(200.0, abs=1.0)


def test_bag_replay_with_the_default_limit_is_never_frozen_even_at_start():
    fd = FrozenDetector(limit=30)
    period = 1_000_000_000 // 60
    stream = [img for img in pictures(30) for _ in range(12)]
    assert not any(feed(fd, stream, period))


def test_slow_retimed_source_learns_its_hold_and_jitter_is_tolerated():
    """1 Hz content at 60 Hz (60 repeats): after the first picture, a picture is frozen only past 3 s."""
    fd = FrozenDetector(limit=30)
    period = 1_000_000_000 // 60
    rng = np.random.default_rng(2)
    stream = []
    for img in pictures(12):
        stream += [img] * int(rng.integers(50, 130))  # 0.8 .. 2.2 s per picture: a late dataset frame
    first_picture = next(i for i, img in enumerate(stream) if img is not stream[0])
    flags = feed(fd, stream, period)
    assert not any(flags[first_picture:])
    assert any(flags[:first_picture])  # the first picture: no typical hold known yet, the count alone decides


def test_retimed_source_whose_picture_really_stops_is_frozen_after_three_typical_holds():
    fd = FrozenDetector(limit=10)
    period = 1_000_000_000 // 60
    bag = pictures(20)
    stream = [img for img in bag for _ in range(12)]
    n = len(stream)
    stream += [bag[-1]] * 60  # the last picture now stands for 12 + 60 frames = 1.2 s
    flags = feed(fd, stream, period)
    # frozen once the picture has stood still longer than 3 x 200 ms = 600 ms: 36 frame periods after its
    # first frame (37 if the float comparison at exactly 600 ms goes the other way), not before
    first = flags.index(True, 12)
    assert first - (n - 12) in (36, 37), (first, n)
    assert all(flags[first:])


def test_resent_messages_with_the_same_stamp_are_duplicates_not_frozen_frames():
    fd = FrozenDetector(limit=5)
    img = pictures(1)[0]
    period = 10 * MS
    flags = feed(fd, [img] * 50, period, stamps=[777 * MS] * 50)  # one message re-sent 50 times
    assert not any(flags)
    assert fd.duplicates == 49 and fd.run_length == 1 and fd.unchanged_s() == 0.0
    # the same picture with new stamps (a stuck driver) is frozen after 5 frames
    fd2 = FrozenDetector(limit=5)
    assert feed(fd2, [img] * 6, period).index(True) == 4 and fd2.duplicates == 0
    # a zero stamp (unstamped publisher) cannot mark a duplicate: such frames count as new
    fd3 = FrozenDetector(limit=5)
    assert feed(fd3, [img] * 6, period, stamps=[0] * 6).index(True) == 4


def test_a_frozen_run_is_not_extended_by_duplicates_and_new_content_clears_it():
    fd = FrozenDetector(limit=3)
    a, b = pictures(2)
    assert feed(fd, [a, a, a], 20 * MS) == [False, False, True]
    last_stamp = 2 * 20 * MS + 1
    assert fd.update(a, stamp_ns=last_stamp, now_ns=10 * S)  # a duplicate: state unchanged, still frozen
    assert fd.unchanged_s() == pytest.approx(0.04) and fd.duplicates == 1
    assert not fd.update(b, stamp_ns=last_stamp, now_ns=10 * S)  # same stamp but new content: a change
    assert fd.frozen_events == 1


def test_typical_hold_is_capped_and_disabled_limit():
    fd = FrozenDetector(limit=2, max_hold_limit_s=2.0)
    a, b, c = pictures(3)
    feed(fd, [a, a, b, b, a, a], 100 * S)  # absurdly long holds (100 s) in the history
    assert fd.hold_limit_s() == 2.0
    assert not fd.update(c, stamp_ns=1, now_ns=1000 * S)
    assert not fd.update(c, stamp_ns=2, now_ns=1002 * S)  # 2 s is not longer than the 2 s cap
    assert fd.update(c, stamp_ns=3, now_ns=1002 * S + 500 * MS)  # frozen despite the long history
    off = FrozenDetector(limit=0)
    assert not any(feed(off, [a] * 100, 100 * MS)) and off.frozen_events == 0


def test_uses_its_clock_when_no_time_is_given():
    clock = FakeClock()
    fd = FrozenDetector(limit=3, clock_ns=clock)
    a, b = pictures(2)
    for img in (a, b, a, b):  # live: holds of 1 s on the fake clock
        fd.update(img, stamp_ns=clock())
        clock.advance_s(1.0)
    flags = []
    for _ in range(5):
        flags.append(fd.update(b, stamp_ns=clock()))
        clock.advance_s(1.0)
    # the run began with the 4th frame; unchanged must exceed 3 x 1 s: 4 s after it is the first frozen
    assert flags == [False, False, False, True, True]
