"""ChunkExecutor: latency compensation, the three merge schemes, run-out / hold, H = 1 == ActionArbiter,
rejections, thread safety."""
import math
import threading

import numpy as np
import pytest

from vla_edge_ros.core.action_arbiter import ActionArbiter
from vla_edge_ros.core.executor import ChunkExecutor

MS = 1_000_000
DT = 10 * MS


def ramp(h, dims=2, offset=0.0):
    """Chunk whose step j is offset + j on every dim: a played value names its step."""
    return np.repeat(offset + np.arange(h, dtype=np.float64)[:, None], dims, axis=1)


def test_latency_compensation_skips_the_steps_already_past():
    ex = ChunkExecutor(action_dims=2, horizon=5, gripper_index=1)
    assert ex.offer(ramp(5), frame_stamp_ns=0, dt_ns=DT, now_ns=23 * MS)  # 23 ms of inference latency
    assert ex.runs_out_ns() == 40 * MS
    d = ex.tick(25 * MS)
    assert (d.kind, d.reason, d.step, d.seq) == ("fresh", "new_chunk", 2, 1)
    assert d.values.tolist() == [2.0, 2.0] and d.age_ms == pytest.approx(25.0)
    assert ex.stats()["skipped_latency"] == 2  # steps 0 and 1 were planned for a state that is gone
    d = ex.tick(29 * MS)
    assert (d.kind, d.reason, d.step) == ("repeat", "same_step", 2)
    d = ex.tick(45 * MS)  # a late tick: step 3 is never played
    assert (d.kind, d.reason, d.step) == ("repeat", "next_step", 4) and d.values.tolist() == [4.0, 4.0]
    d = ex.tick(52 * MS)
    assert (d.kind, d.reason, d.step) == ("repeat", "ran_out", 4) and d.values.tolist() == [4.0, 4.0]
    s = ex.stats()
    assert s["skipped_gap"] == 1 and s["repeat_reasons"] == {"same_step": 1, "next_step": 1, "ran_out": 1}


def test_latest_newest_chunk_wins_from_its_first_due_step():
    ex = ChunkExecutor(action_dims=2, horizon=4, merge="latest", gripper_index=None)
    ex.offer(ramp(4), 0, DT, 1 * MS)
    assert ex.tick(5 * MS).values.tolist() == [0.0, 0.0]
    ex.offer(ramp(4, offset=100.0), 10 * MS, DT, 27 * MS)
    d = ex.tick(28 * MS)  # B's step 1 (due 20..30 ms), not A's step 2
    assert (d.kind, d.step, d.seq, d.source_stamp_ns) == ("fresh", 1, 2, 10 * MS)
    assert d.values.tolist() == [101.0, 101.0]
    s = ex.stats()
    assert s["merges"] == 1 and s["skipped_latency"] == 1 and s["live_chunks"] == 1
    assert ex.runs_out_ns() == 40 * MS


def test_temporal_ensemble_weights_hand_computed():
    ex = ChunkExecutor(action_dims=1, horizon=4, merge="temporal_ensemble", gripper_index=None, ensemble_m=0.5)
    ex.offer([[1.0], [2.0], [3.0], [4.0]], 0, DT, 1 * MS)
    ex.offer([[10.0], [20.0], [30.0], [40.0]], 10 * MS, DT, 12 * MS)
    ex.offer([[100.0], [200.0], [300.0], [400.0]], 20 * MS, DT, 22 * MS)
    d = ex.tick(25 * MS)  # for this time: A's step 2, B's step 1, C's step 0; weights exp(-0.5 i), 0 = oldest
    w0, w1, w2 = 1.0, math.exp(-0.5), math.exp(-1.0)
    assert d.values[0] == pytest.approx((3 * w0 + 20 * w1 + 100 * w2) / (w0 + w1 + w2))
    assert d.values[0] == pytest.approx(26.2957312)
    assert (d.kind, d.seq, d.step, d.merged) == ("fresh", 3, 0, 3)
    d = ex.tick(42 * MS)  # A has run out (dropped); B's step 3 and C's step 2 remain, B now the oldest
    assert d.values[0] == pytest.approx((40 * w0 + 300 * w1) / (w0 + w1)) == pytest.approx(138.1605739)
    assert (d.kind, d.merged) == ("repeat", 2) and ex.stats()["live_chunks"] == 2
    d = ex.tick(55 * MS)
    assert (d.values[0], d.merged, d.reason) == (400.0, 1, "next_step")
    d = ex.tick(65 * MS)
    assert (d.values[0], d.reason) == (400.0, "ran_out")
    assert ex.stats()["merges"] == 2


def test_temporal_ensemble_default_m_is_act_0_01():
    ex = ChunkExecutor(action_dims=1, horizon=4, merge="temporal_ensemble", gripper_index=None)
    ex.offer([[10.0]] * 4, 0, DT, 0)
    ex.offer([[20.0]] * 4, 10 * MS, DT, 10 * MS)
    w = math.exp(-0.01)
    assert ex.tick(15 * MS).values[0] == pytest.approx((10 + 20 * w) / (1 + w)) == pytest.approx(14.9750002)


def test_blend_keeps_the_committed_prefix_exactly_then_blends_linearly():
    ex = ChunkExecutor(action_dims=2, horizon=8, merge="blend", gripper_index=None, blend_steps=2)
    a = ramp(8) * np.array([1.0, -1.0]) + 0.123456789  # distinct, non-round values
    ex.offer(a, 0, DT, 0)
    played = [ex.tick(t * MS).values for t in (0, 10, 20)]
    prefix = ex.committed_prefix(20 * MS, 3)  # the next chunk is computed from the frame stamped 20 ms
    assert np.array_equal(prefix, a[2:5])
    b = ramp(8, offset=100.0)
    ex.offer(b, 20 * MS, DT, 43 * MS)  # latency 23 ms -> d = ceil(2.3) = 3 steps committed
    for t in (45, 50, 60, 70):
        played.append(ex.tick(t * MS).values)
    assert np.array_equal(played[3], a[4]) and np.array_equal(played[3], prefix[2])  # bit-exact
    np.testing.assert_allclose(played[4], (2 / 3) * a[5] + (1 / 3) * b[3])
    np.testing.assert_allclose(played[5], (1 / 3) * a[6] + (2 / 3) * b[4])
    np.testing.assert_allclose(played[6], b[5])
    # the rewritten chunk's own prefix is the committed steps too (what force-decoding would have produced)
    ex2 = ChunkExecutor(action_dims=2, horizon=8, merge="blend", gripper_index=None, blend_steps=2)
    ex2.offer(a, 0, DT, 0)
    ex2.offer(b, 20 * MS, DT, 43 * MS)
    assert np.array_equal(ex2.committed_prefix(20 * MS, 3), a[2:5])
    s = ex.stats()
    assert s["committed_steps_kept"] == 3 and s["merges"] == 1


def test_blend_commits_nothing_beyond_the_end_of_the_executing_chunk():
    ex = ChunkExecutor(action_dims=2, horizon=3, merge="blend", gripper_index=None, blend_steps=2)
    ex.offer(ramp(3), 0, DT, 0)
    ex.tick(0)
    ex.offer(ramp(3, offset=50.0), 40 * MS, DT, 45 * MS)  # A's plan ended at 30 ms
    assert ex.tick(45 * MS).values.tolist() == [50.0, 50.0]
    assert ex.stats()["committed_steps_kept"] == 0
    assert ex.committed_prefix(70 * MS, 4).shape == (0, 2)  # B ran out at 70 ms: nothing planned
    assert ex.committed_prefix(50 * MS, 4).tolist() == [[51.0, 51.0], [52.0, 52.0]]


def test_run_out_repeats_last_step_while_live_then_holds_once_stale():
    ex = ChunkExecutor(action_dims=3, horizon=3, gripper_index=2, stale_after_ms=100.0)
    for t in range(0, 50, 10):
        ex.note_frame(t * MS, t * MS)
    chunk = np.array([[1.0, 1.0, 0.0], [2.0, 2.0, 1.0], [3.0, 3.0, 0.5]])
    ex.offer(chunk, 0, DT, 5 * MS)
    kinds = [ex.tick(t * MS) for t in (5, 15, 25, 35, 104)]
    assert [(d.kind, d.reason) for d in kinds] == [("fresh", "new_chunk"), ("repeat", "next_step"),
                                                   ("repeat", "next_step"), ("repeat", "ran_out"),
                                                   ("repeat", "ran_out")]
    assert kinds[-1].values.tolist() == [3.0, 3.0, 0.5]
    d = ex.tick(106 * MS)  # chunk received at 5 ms: 101 ms old
    assert (d.kind, d.reason, d.step, d.merged) == ("hold", "action_stale", -1, 0)
    assert d.values.tolist() == [0.0, 0.0, 0.5]  # zero motion, gripper unchanged
    assert ex.runs_out_ns() is None and ex.tick(200 * MS).reason == "frame_stale"  # last frame at 40 ms
    assert ex.stats()["hold_reasons"] == {"action_stale": 1, "frame_stale": 1}


def test_silent_camera_does_not_stop_a_chunk_but_explicit_marks_do():
    ex = ChunkExecutor(action_dims=2, horizon=20, gripper_index=1, stale_after_ms=50.0)
    ex.note_frame(0, 0)
    ex.offer(ramp(20), 0, DT, 5 * MS)
    assert ex.tick(100 * MS).kind == "fresh"  # frame 100 ms old, but the plan covers 0..200 ms
    assert ex.tick(150 * MS).reason == "next_step"
    assert (ex.tick(200 * MS).kind, ex.tick(200 * MS).reason) == ("hold", "frame_stale")  # ran out, stale
    ex.note_frame(210 * MS, 210 * MS)
    ex.offer(ramp(20), 210 * MS, DT, 215 * MS)
    assert ex.tick(215 * MS).kind == "fresh"
    ex.mark_inputs_stale("liveliness_lost")
    d = ex.tick(225 * MS)
    assert (d.kind, d.reason, d.values.tolist()) == ("hold", "stale:liveliness_lost", [0.0, 0.0])
    ex.clear_stale("liveliness_lost")
    assert ex.tick(230 * MS).reason == "awaiting_fresh"  # never resume the pre-hold plan
    ex.offer(ramp(20, offset=7.0), 230 * MS, DT, 232 * MS)
    assert ex.tick(235 * MS).values.tolist() == [7.0, 7.0]


def test_nothing_yet_is_a_hold_with_the_initial_gripper():
    d = ChunkExecutor(initial_gripper=0.7, horizon=4).tick(0)
    assert (d.kind, d.reason, d.seq, d.source_stamp_ns) == ("hold", "no_action_yet", 0, 0)
    assert d.values.tolist() == [0, 0, 0, 0, 0, 0, pytest.approx(0.7)] and math.isnan(d.age_ms)


def _random_events(rng, dt_ms=33.0, duration_ms=6000.0):
    """Camera frames (with dropouts), inference offers after a random latency (sometimes reordered or
    non-finite), stale marks, and jittered ticks: (time_ns, order, kind, payload) sorted by time."""
    ev, t, order = [], 0.0, 0
    while t < duration_ms:
        t += dt_ms + rng.uniform(-3, 3) + (rng.uniform(150, 400) if rng.random() < 0.03 else 0.0)
        stamp = int(t * MS)
        ev.append((stamp + int(rng.uniform(0, 2) * MS), "frame", stamp))
        if rng.random() < 0.6:
            latency = rng.uniform(3, 60) if rng.random() < 0.9 else rng.uniform(100, 300)
            action = rng.uniform(-1, 1, 7)
            if rng.random() < 0.03:
                action[rng.integers(7)] = math.nan
            ev.append((stamp + int((2 + latency) * MS), "offer", (action, stamp)))
    for _ in range(int(duration_ms / 500)):
        start = rng.uniform(0, duration_ms)
        ev.append((int(start * MS), "mark", None))
        ev.append((int((start + rng.uniform(10, 200)) * MS), "clear", None))
    tick = 0.0
    while tick < duration_ms + 500:
        tick += dt_ms + rng.uniform(-5, 5)
        ev.append((int(tick * MS), "tick", None))
    return sorted(ev, key=lambda e: (e[0], ("frame", "mark", "clear", "offer", "tick").index(e[1])))


# (seed, merge, stamp clock offset): H = 1 is the arbiter whatever the merge scheme and however far the stamps'
# clock is off the receiver's (a robot/edge split without synchronised clocks: ahead by 1 s, behind by 5 s)
@pytest.mark.parametrize("seed, merge, skew_ms", [(0, "latest", 0), (1, "latest", 0), (2, "latest", 0),
                                                  (3, "temporal_ensemble", 0), (4, "blend", 0),
                                                  (5, "latest", 1000), (6, "blend", -5000)])
def test_horizon_1_behaves_like_action_arbiter(seed, merge, skew_ms):
    rng = np.random.default_rng(seed)
    arb = ActionArbiter(stale_after_ms=100.0, initial_gripper=0.3)
    ex = ChunkExecutor(horizon=1, merge=merge, stale_after_ms=100.0, initial_gripper=0.3)
    dt_ns = 33 * MS
    n_ticks = 0
    for now, kind, payload in _random_events(rng):
        if kind == "frame":
            arb.note_frame(payload + skew_ms * MS, now)
            ex.note_frame(payload + skew_ms * MS, now)
        elif kind == "offer":
            action, stamp = payload[0], payload[1] + skew_ms * MS
            assert arb.offer(action, stamp, now) == ex.offer(action, stamp, dt_ns, now)
        elif kind in ("mark", "clear"):
            for target in (arb, ex):
                (target.mark_inputs_stale if kind == "mark" else target.clear_stale)("flap")
        else:
            a, e = arb.tick(now), ex.tick(now)
            n_ticks += 1
            assert (e.kind, e.seq, e.source_stamp_ns) == (a.kind, a.seq, a.source_stamp_ns), (now, a, e)
            assert np.array_equal(e.values, a.values), (now, a, e)
            assert e.reason == ("new_chunk" if a.kind == "fresh" else a.reason), (now, a, e)
    a_stats, e_stats = arb.stats(), ex.stats()
    assert e_stats["ticks"] == a_stats["ticks"] and sum(a_stats["ticks"].values()) == n_ticks
    assert e_stats["hold_reasons"] == a_stats["hold_reasons"] and e_stats["rejected"] == a_stats["rejected"]
    # the sequence exercised every path being compared
    assert min(a_stats["ticks"].values()) > 10 and a_stats["rejected"].get("out_of_order", 0) > 0
    assert {"frame_stale", "action_stale", "stale:flap", "awaiting_fresh"} <= set(a_stats["hold_reasons"])
    assert e_stats["repeat_reasons"] == {"no_new_action": a_stats["ticks"]["repeat"]}


def test_set_horizon_drops_the_plan_of_the_old_shape_and_counts():
    ex = ChunkExecutor(action_dims=2, horizon=1, gripper_index=None)
    assert ex.offer([1.0, 2.0], 0, DT, 1 * MS) and ex.tick(2 * MS).kind == "fresh"
    assert not ex.offer(ramp(4), 5 * MS, DT, 6 * MS) and ex.stats()["rejected"] == {"bad_shape": 1}
    ex.set_horizon(4)
    assert ex.tick(7 * MS).reason == "awaiting_fresh"  # the H = 1 plan is gone, not replayed
    assert ex.offer(ramp(4), 10 * MS, DT, 11 * MS)
    assert [ex.tick(t * MS).step for t in (12, 22, 32, 42)] == [0, 1, 2, 3]
    ex.set_horizon(4)  # unchanged: nothing dropped, not counted
    assert ex.stats()["horizon_changes"] == 1 and ex.stats()["live_chunks"] == 1
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError):
            ex.set_horizon(bad)


def test_future_stamps_are_checked_only_when_steps_are_timed_by_them():
    one = ChunkExecutor(action_dims=2, horizon=1, gripper_index=None)
    assert one.offer([1.0, 1.0], 10_000 * MS, DT, 0)  # provenance only: accepted, as by the arbiter
    four = ChunkExecutor(action_dims=2, horizon=4, gripper_index=None)
    assert not four.offer(ramp(4), 10_000 * MS, DT, 0) and four.stats()["rejected"] == {"future_stamp": 1}


def test_every_rejection_reason_is_counted_and_the_plan_goes_on():
    ex = ChunkExecutor(action_dims=7, horizon=2, stale_after_ms=20.0, future_tolerance_ms=5.0)
    good = np.arange(14, dtype=np.float64).reshape(2, 7) / 10
    assert ex.offer(good, 50 * MS, DT, 52 * MS)
    assert ex.tick(52 * MS).kind == "fresh"
    nan, inf = good.copy(), good.copy()
    nan[1, 3], inf[0, 0] = math.nan, -math.inf
    bad = [(np.zeros((3, 7)), 55, "bad_shape"), (np.zeros((2, 6)), 55, "bad_shape"),
           (np.zeros(7), 55, "bad_shape"), ([[1.0, 2.0], [3.0]], 55, "bad_shape"),
           (np.zeros((0, 7)), 55, "empty"), (None, 55, "empty"), (nan, 55, "non_finite"),
           (inf, 55, "non_finite"), (good, 59, "future_stamp"), (good, 40, "out_of_order")]
    for chunk, stamp_ms, reason in bad:
        assert not ex.offer(chunk, stamp_ms * MS, DT, 53 * MS), reason
        assert reason in ex.stats()["rejected"]
    assert not ex.offer(good, 55 * MS, 0, 53 * MS)
    s = ex.stats()
    assert s["rejected"] == {"bad_shape": 4, "empty": 2, "non_finite": 2, "future_stamp": 1, "out_of_order": 1,
                             "bad_dt": 1}
    assert s["offered"] == s["accepted"] + sum(s["rejected"].values()) == 12
    d = ex.tick(61 * MS)
    assert (d.kind, d.seq, d.step) == ("repeat", 1, 1) and np.array_equal(d.values, good[1])
    assert ex.offer(good + 1, 57 * MS, DT, 53 * MS)  # 4 ms ahead: within the clock tolerance, due now
    assert ex.tick(62 * MS).step == 0
    assert ex.offer(good, 1 * MS, DT, 63 * MS) and ex.stats()["stamp_resets"] == 1  # 56 ms back > 20: restarted


def test_constructor_and_argument_validation():
    for kwargs in ({"horizon": 0}, {"action_dims": 0}, {"gripper_index": 7}, {"merge": "average"},
                   {"ensemble_m": -1.0}, {"ensemble_m": math.nan}, {"blend_steps": -1}, {"blend_steps": 1.5},
                   {"future_tolerance_ms": -1.0}, {"stale_after_ms": 0.0}):
        with pytest.raises(ValueError):
            ChunkExecutor(**kwargs)
    with pytest.raises(ValueError):
        ChunkExecutor().committed_prefix(0, -1)


@pytest.mark.parametrize("merge", ["latest", "temporal_ensemble", "blend"])
def test_concurrent_offers_and_ticks(merge):
    ex = ChunkExecutor(action_dims=7, horizon=8, merge=merge, stale_after_ms=1e5)
    n, clock = 2000, [0]
    errors, decisions, prefixes = [], [], []
    stop = threading.Event()

    def offerer():
        try:
            for i in range(1, n + 1):
                clock[0] = i * MS
                chunk = np.full((8, 7), i / n)
                if i % 10 == 0:
                    chunk[3, 2] = math.nan
                ex.note_frame(i * MS, i * MS)
                ex.offer(chunk, i * MS, DT, i * MS)
        except Exception as e:  # pragma: no cover - shows up in the assertion
            errors.append(e)

    def ticker():
        try:
            while not stop.is_set():
                decisions.append(ex.tick(clock[0]))
                prefixes.append(ex.committed_prefix(clock[0], 3))
                ex.runs_out_ns()
        except Exception as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=offerer), threading.Thread(target=ticker)]
    for t in threads:
        t.start()
    threads[0].join(60)
    stop.set()
    threads[1].join(60)
    assert not errors
    s = ex.stats()
    assert s["offered"] == n and s["rejected"] == {"non_finite": n // 10}
    assert s["accepted"] == n - n // 10 and sum(s["ticks"].values()) == len(decisions) > 0
    fresh = [d.seq for d in decisions if d.kind == "fresh"]
    assert fresh and all(a < b for a, b in zip(fresh, fresh[1:])), "a fresh chunk went backwards"
    assert all(d.values.shape == (7,) and np.all(np.isfinite(d.values)) for d in decisions)
    assert all(p.ndim == 2 and p.shape[1] == 7 and p.shape[0] <= 3 for p in prefixes)
