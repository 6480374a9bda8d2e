"""ActionArbiter: fresh / repeat / hold decisions, staleness inputs, rejections, thread safety."""
import math
import threading

import numpy as np
import pytest

from vla_edge_ros.core.action_arbiter import ActionArbiter

MS = 1_000_000


def act(*vals):
    return np.array(vals, dtype=np.float32)


A1 = act(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 1.0)
A2 = act(-0.1, -0.2, -0.3, -0.4, -0.5, -0.6, 0.0)


def test_hold_before_anything_arrives():
    arb = ActionArbiter(initial_gripper=0.7)
    d = arb.tick(0)
    assert d.kind == "hold" and d.reason == "no_action_yet"
    assert d.values.tolist() == [0, 0, 0, 0, 0, 0, pytest.approx(0.7)]
    assert d.seq == 0 and d.source_stamp_ns == 0 and math.isnan(d.age_ms)


def test_fresh_then_repeat_then_hold_on_action_age():
    arb = ActionArbiter(stale_after_ms=100.0)
    assert arb.offer(A1, frame_stamp_ns=5 * MS, now_ns=10 * MS)
    d = arb.tick(20 * MS)
    assert d.kind == "fresh" and d.seq == 1 and d.source_stamp_ns == 5 * MS
    assert d.age_ms == pytest.approx(15.0)
    np.testing.assert_allclose(d.values, A1)
    d = arb.tick(53 * MS)
    assert d.kind == "repeat" and d.seq == 1 and d.source_stamp_ns == 5 * MS
    assert d.age_ms == pytest.approx(48.0)
    np.testing.assert_allclose(d.values, A1)
    d = arb.tick(110 * MS)  # action received at 10 ms: exactly 100 ms old is not yet stale
    assert d.kind == "repeat"
    d = arb.tick(111 * MS)
    assert d.kind == "hold" and d.reason == "action_stale"
    # zero motion, gripper unchanged at its last commanded value
    np.testing.assert_allclose(d.values, [0, 0, 0, 0, 0, 0, 1.0])
    assert arb.tick(500 * MS).kind == "hold"
    assert arb.counts == {"fresh": 1, "repeat": 2, "hold": 2}


def test_frame_staleness_forces_hold_even_with_a_recent_action():
    arb = ActionArbiter(stale_after_ms=50.0)
    arb.note_frame(0, now_ns=0)
    arb.offer(A1, 0, now_ns=40 * MS)  # a slow chunk delivers late, camera already silent
    d = arb.tick(60 * MS)
    assert d.kind == "hold" and d.reason == "frame_stale"
    arb.note_frame(70 * MS, now_ns=70 * MS)  # frames return
    assert arb.tick(75 * MS).kind == "hold"  # holding until a fresh action
    arb.offer(A2, 70 * MS, now_ns=80 * MS)
    d = arb.tick(85 * MS)
    assert d.kind == "fresh" and d.seq == 2
    np.testing.assert_allclose(d.values, A2)


def test_explicit_stale_reasons_hold_until_cleared_and_a_fresh_action_arrives():
    arb = ActionArbiter()
    arb.offer(A1, 0, 0)
    assert arb.tick(1 * MS).kind == "fresh"
    arb.mark_inputs_stale("camera_deadline_missed")
    arb.mark_inputs_stale("inference_inactive")
    d = arb.tick(2 * MS)
    assert d.kind == "hold" and d.reason == "stale:camera_deadline_missed,inference_inactive"
    assert d.values[6] == pytest.approx(1.0)
    arb.clear_stale("camera_deadline_missed")
    assert arb.tick(3 * MS).kind == "hold"
    assert arb.stale_reasons == ("inference_inactive",)
    arb.clear_stale("inference_inactive")
    arb.clear_stale("never_set")  # harmless
    d = arb.tick(4 * MS)
    assert d.kind == "hold" and d.reason == "awaiting_fresh"  # never repeat a pre-hold command
    arb.offer(A2, 4 * MS, 4 * MS)
    assert arb.tick(5 * MS).kind == "fresh"
    assert arb.tick(6 * MS).kind == "repeat"
    assert arb.hold_reasons["awaiting_fresh"] == 1


def test_action_arriving_during_hold_is_consumed_by_it():
    arb = ActionArbiter()
    arb.mark_inputs_stale("liveliness_lost")
    arb.offer(A1, 0, 0)
    assert arb.tick(1 * MS).kind == "hold"
    arb.clear_stale("liveliness_lost")
    assert arb.tick(2 * MS).kind == "hold"


def test_gripper_kept_across_holds_and_several_fresh_actions():
    arb = ActionArbiter(stale_after_ms=10.0)
    arb.offer(A1, 0, 0)
    arb.tick(1 * MS)
    arb.offer(A2, 1 * MS, 2 * MS)
    arb.tick(3 * MS)
    d = arb.tick(100 * MS)
    assert d.kind == "hold" and d.values[6] == pytest.approx(0.0)  # A2's gripper, not A1's


def test_invalid_actions_are_rejected_and_counted():
    arb = ActionArbiter(stale_after_ms=20.0)
    assert not arb.offer(np.zeros(6), 0, 0)
    assert not arb.offer(act(0, 0, 0, math.nan, 0, 0, 0), 0, 0)
    assert not arb.offer(None, 0, 0)
    assert arb.tick(1 * MS).kind == "hold"
    assert arb.offer(A1, 50 * MS, 50 * MS)
    assert not arb.offer(A2, 40 * MS, 51 * MS)  # reordered: older frame than the current action
    assert arb.rejected == {"bad_shape": 2, "non_finite": 1, "out_of_order": 1}
    assert str(40 * MS) in arb.last_reject_message and str(50 * MS) in arb.last_reject_message
    d = arb.tick(52 * MS)
    assert d.kind == "fresh"
    np.testing.assert_allclose(d.values, A1)
    # a jump back by more than the staleness limit is a restarted source: accepted
    assert arb.offer(A2, 1 * MS, 53 * MS)
    assert arb.stamp_resets == 1
    np.testing.assert_allclose(arb.tick(54 * MS).values, A2)


def test_values_returned_are_private_copies():
    arb = ActionArbiter()
    a = A1.copy()
    arb.offer(a, 0, 0)
    a[:] = 9.0
    d = arb.tick(1 * MS)
    d.values[:] = 5.0
    np.testing.assert_allclose(arb.tick(2 * MS).values, A1)


def test_live_stale_after_change_and_validation():
    arb = ActionArbiter(stale_after_ms=500.0)
    arb.offer(A1, 0, 0)
    arb.tick(1 * MS)
    assert arb.tick(300 * MS).kind == "repeat"
    arb.set_stale_after_ms(100.0)
    assert arb.tick(301 * MS).kind == "hold"
    for bad in (0.0, -5.0, "100", math.nan):
        with pytest.raises(ValueError):
            arb.set_stale_after_ms(bad)
    assert arb.stale_after_ms == 100.0


def test_constructor_validation_and_no_gripper():
    with pytest.raises(ValueError):
        ActionArbiter(action_dims=7, gripper_index=7)
    with pytest.raises(ValueError):
        ActionArbiter(action_dims=0)
    arb = ActionArbiter(action_dims=3, gripper_index=None)
    arb.offer(np.ones(3), 0, 0)
    arb.tick(1 * MS)
    assert arb.tick(10_000 * MS).values.tolist() == [0.0, 0.0, 0.0]


def test_concurrent_offers_frames_marks_and_ticks():
    arb = ActionArbiter(stale_after_ms=1e5)
    n = 3000
    stop = threading.Event()
    errors = []
    decisions = []

    def offerer():
        try:
            for i in range(1, n + 1):
                arb.note_frame(i * MS, i * MS)
                arb.offer(np.full(7, i / n), i * MS, i * MS)
        except Exception as e:  # pragma: no cover - a failure shows up in the assertion
            errors.append(e)

    def marker():
        while not stop.is_set():
            arb.mark_inputs_stale("flap")
            arb.clear_stale("flap")

    def ticker():
        i = 0
        while not stop.is_set():
            i += 1
            decisions.append(arb.tick((n + 1) * MS))

    threads = [threading.Thread(target=f) for f in (offerer, marker, ticker)]
    for t in threads:
        t.start()
    threads[0].join(60)
    stop.set()
    for t in threads[1:]:
        t.join(60)
    assert not errors
    assert arb.offered == n and not arb.rejected
    assert sum(arb.counts.values()) == len(decisions) > 0
    fresh_seqs = [d.seq for d in decisions if d.kind == "fresh"]
    assert all(a < b for a, b in zip(fresh_seqs, fresh_seqs[1:])), "a fresh action went backwards"
    for d in decisions:
        assert d.values.shape == (7,)
        if d.kind == "fresh":
            np.testing.assert_allclose(d.values, d.seq / n)  # values and seq come from the same action
