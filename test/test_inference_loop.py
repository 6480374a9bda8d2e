"""InferenceLoop with a fake engine: admission, saliency, faults, late chunks, warm-up, live updates, thread."""
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest

from fake_clock import MS, FakeClock
from vla_edge_ros.core.admission import AdmissionController, Decision
from vla_edge_ros.core.double_buffer import DoubleBuffer
from vla_edge_ros.core.inference_loop import ADMITTED, ERROR, LATE, REFUSED, InferenceLoop, cosine_distance
from vla_edge_ros.engine.interface import ChunkResult, Engine


@dataclass
class Frame:
    image: np.ndarray
    stamp_ns: int
    received_ns: int
    frame_id: int


def frame(fid: int, colour=(200, 10, 10)) -> Frame:
    img = np.empty((8, 8, 3), np.uint8)
    img[:] = colour
    return Frame(img, stamp_ns=fid * 33 * MS, received_ns=fid * 33 * MS, frame_id=fid)


class FakeEngine(Engine):
    """Deterministic engine: costs advance a fake clock (or really sleep), failures on chosen frame ids."""

    name = "fake"

    def __init__(self, clock=None, encode_ms=1.0, prefill_ms=6.0, decode_ms=8.0, sleep=False):
        self.clock, self.sleep = clock, sleep
        self.encode_ms, self.prefill_ms, self.decode_ms = encode_ms, prefill_ms, decode_ms
        self.extra_ms: dict[int, float] = {}  # frame id -> extra run time (a hung chunk)
        self.fail: dict[int, BaseException] = {}
        self.needs_reset = False
        self.resets = 0
        self.chunks: list[tuple[int, bool]] = []
        self.in_chunk = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def _spend(self, ms):
        if self.sleep:
            time.sleep(ms / 1e3)
        else:
            self.clock.advance_ms(ms)

    @property
    def tokens_per_frame(self) -> int:
        return 4

    def encode_frame(self, image):
        self._spend(self.encode_ms)
        return np.repeat(image[0, :4, :].astype(np.float32), 2, axis=1)  # (4, 6): colour decides the direction

    def run_chunk(self, vision_tokens, frame_id, salient=False):
        self.in_chunk.set()
        self.release.wait(30)
        self._spend(self.prefill_ms + self.extra_ms.get(frame_id, 0.0))
        if frame_id in self.fail:
            exc = self.fail[frame_id]
            if getattr(exc, "poison", False):
                self.needs_reset = True
            raise exc
        self._spend(self.decode_ms)
        self.chunks.append((frame_id, salient))
        return ChunkResult(frame_id=frame_id, token_ids=np.zeros(9, np.int64), action_bins=np.zeros(7, np.int64),
                           action=np.full(7, frame_id, np.float32), prefill_ms=self.prefill_ms,
                           decode_ms=self.decode_ms, total_ms=self.prefill_ms + self.decode_ms)

    def reset(self):
        self.resets += 1
        self.needs_reset = False

    def memory(self):
        return {"current_bytes": 0, "peak_bytes": 0}


class Harness:
    def __init__(self, period_ms=33.0, deadline_ms=33.0, margin_ms=2.0, **loop_kw):
        self.clock = FakeClock()
        self.engine = FakeEngine(self.clock)
        self.buffer = DoubleBuffer()
        self.admission = AdmissionController(deadline_ms, margin_ms, ema_alpha=0.5)
        self.actions, self.events = [], []
        self.loop = InferenceLoop(self.engine, self.buffer, self.admission, period_ms,
                                  on_action=lambda r, f: self.actions.append((r, f)),
                                  on_event=lambda k, i: self.events.append((k, i)),
                                  decode_tokens=8, time_ns=self.clock, **loop_kw)

    def event_kinds(self):
        return [k for k, _ in self.events]


def test_admitted_chunk_delivers_the_action_and_feeds_the_emas():
    h = Harness()
    assert h.loop.step(frame(1)) == ADMITTED
    (result, f), = h.actions
    assert f.frame_id == 1 and result.frame_id == 1
    np.testing.assert_allclose(result.action, 1.0)
    assert result.salient  # first frame: a new scene
    # encode (1 ms) counts as prefill; the 8 ms decode over 8 tokens is 1 ms/token
    assert h.admission.prefill_ema_ms == pytest.approx(7.0)
    assert h.admission.decode_ema_ms_per_token == pytest.approx(1.0)
    s = h.loop.stats()
    assert (s["admitted"], s["completed"], s["refused"], s["deadline_misses"]) == (1, 1, 0, 0)
    assert s["chunk_ms"]["count"] == 1 and s["chunk_ms"]["p50"] == pytest.approx(15.0)
    assert s["admission"]["recorded"] == 1


def test_refusal_when_the_estimate_does_not_fit_the_time_left_in_this_cycle():
    h = Harness()
    h.admission.seed(7.0, 1.0)  # 15 ms estimate
    h.clock.advance_ms(10.0)  # 23 ms left, 21 ms budget: fits
    assert h.loop.step(frame(1)) == ADMITTED
    # the clock is now at 25 ms into the cycle: 8 ms left, 6 ms budget
    assert h.loop.step(frame(2)) == REFUSED
    assert [r.frame_id for r, _ in h.actions] == [1]
    assert h.loop.refused == 1 and h.admission.refused == 1
    h.clock.advance_ms(8.0)  # next cycle (33 ms), plenty of time again
    assert h.loop.step(frame(3)) == ADMITTED


def test_saliency_tags_scene_changes_and_threshold_updates_apply_next_cycle():
    h = Harness(period_ms=1000.0, deadline_ms=1000.0)
    red, green = (200, 10, 10), (10, 200, 10)
    h.loop.step(frame(1, red))
    h.loop.step(frame(2, red))
    h.loop.step(frame(3, green))
    assert [s for _, s in h.engine.chunks] == [True, False, True]
    d = cosine_distance(np.array([200, 10, 10.0]), np.array([10, 200, 10.0]))
    h.loop.update(saliency_threshold=min(2.0, d + 0.1))
    h.loop.step(frame(4, red))
    assert h.engine.chunks[-1][1] is True  # not applied yet: the old threshold
    h.loop.apply_pending_updates()
    h.loop.step(frame(5, green))
    assert h.engine.chunks[-1][1] is False
    assert h.loop.stats()["salient_frames"] == 3
    assert "params_applied" in h.event_kinds()


def test_cosine_distance_edge_cases():
    assert cosine_distance(np.ones(3), np.ones(3)) == pytest.approx(0.0)
    assert cosine_distance(np.array([1.0, 0]), np.array([-1.0, 0])) == pytest.approx(2.0)
    assert cosine_distance(np.zeros(3), np.zeros(3)) == 0.0
    assert cosine_distance(np.zeros(3), np.ones(3)) == 1.0


def test_exception_is_reported_and_the_loop_recovers_without_reset_when_state_is_fine():
    h = Harness(period_ms=1000.0, deadline_ms=1000.0)
    h.engine.fail[2] = RuntimeError("kernel exploded")
    assert [h.loop.step(frame(i)) for i in (1, 2, 3)] == [ADMITTED, ERROR, ADMITTED]
    (kind, info), = [(k, i) for k, i in h.events if k == "chunk_error"]
    assert info["frame_id"] == 2 and "kernel exploded" in info["error"] and info["type"] == "RuntimeError"
    assert info["reset"] is False and h.engine.resets == 0
    s = h.loop.stats()
    assert s["errors"] == 1 and s["completed"] == 2 and "kernel exploded" in s["last_error"]
    assert [r.frame_id for r, _ in h.actions] == [1, 3]


def test_engine_is_reset_when_it_reports_bad_state_or_runs_out_of_memory():
    h = Harness(period_ms=1000.0, deadline_ms=1000.0)
    poisoned = RuntimeError("KV half written")
    poisoned.poison = True
    h.engine.fail[2] = poisoned
    h.engine.fail[4] = MemoryError("out of memory")
    outcomes = [h.loop.step(frame(i)) for i in range(1, 6)]
    assert outcomes == [ADMITTED, ERROR, ADMITTED, ERROR, ADMITTED]
    assert h.engine.resets == 2 and h.loop.engine_resets == 2
    assert [i["reset"] for k, i in h.events if k == "chunk_error"] == [True, True]
    # after a reset the next frame is a new scene for the cache
    assert dict(h.engine.chunks)[3] is True


def test_failing_reset_is_reported_and_does_not_kill_the_loop():
    h = Harness(period_ms=1000.0, deadline_ms=1000.0)
    h.engine.fail[1] = MemoryError("oom")

    def bad_reset():
        raise RuntimeError("device lost")

    h.engine.reset = bad_reset
    assert h.loop.step(frame(1)) == ERROR
    info = [i for k, i in h.events if k == "chunk_error"][0]
    assert "device lost" in info["reset_error"]
    h.engine.fail.clear()
    assert h.loop.step(frame(2)) == ADMITTED


def test_overrunning_chunk_is_a_deadline_miss_and_a_hung_one_is_discarded():
    h = Harness()  # 33 ms cycles, 33 ms deadline
    h.engine.extra_ms[1] = 20.0  # 35 ms: misses by 2 ms, still delivered
    h.engine.extra_ms[2] = 200.0  # hung: finishes ~6 cycles late
    assert h.loop.step(frame(1)) == ADMITTED
    h.clock.t = h.loop.clock.next_deadline(h.clock.t)  # start of a cycle
    assert h.loop.step(frame(2)) == REFUSED  # the EMAs learnt the 35 ms chunk: it no longer fits
    h.admission.seed(0.0, 0.0)  # an optimistic estimate lets the hang in
    h.clock.t = h.loop.clock.next_deadline(h.clock.t)
    assert h.loop.step(frame(2)) == LATE
    assert [r.frame_id for r, _ in h.actions] == [1]
    s = h.loop.stats()
    assert s["deadline_misses"] == 2 and s["admission"]["deadline_misses"] == 2
    assert s["late_discarded"] == 1 and s["completed"] == 2
    kinds = h.event_kinds()
    assert kinds.count("deadline_miss") == 2 and kinds.count("chunk_late_discarded") == 1
    # an error that also overran is a miss too
    h.clock.t = h.loop.clock.next_deadline(h.clock.t)
    h.engine.extra_ms[3] = 100.0
    h.engine.fail[3] = RuntimeError("late and broken")
    h.admission.seed(0.0, 0.0)
    assert h.loop.step(frame(3)) == ERROR
    assert h.admission.deadline_misses == 3


def test_action_callback_errors_are_counted_not_fatal():
    h = Harness(period_ms=1000.0, deadline_ms=1000.0)

    def broken(result, f):
        raise ValueError("publisher gone")

    h.loop.on_action = broken
    h.loop.on_event = lambda k, i: (_ for _ in ()).throw(RuntimeError("logger gone"))
    assert h.loop.step(frame(1)) == ADMITTED
    assert h.loop.callback_errors >= 2


def test_warmup_seeds_emas_outside_live_figures_and_resets_the_engine():
    h = Harness()
    h.engine.extra_ms[-1] = 50.0  # the first warm-up chunk is slow (allocation / compile): left out
    fig = h.loop.warmup(3)
    assert h.engine.resets == 1
    assert [fid for fid, _ in h.engine.chunks] == [-1, -2, -3]
    assert fig["prefill_ms"] == pytest.approx(7.0) and fig["decode_ms_per_token"] == pytest.approx(1.0)
    assert h.admission.estimate_ms(8) == pytest.approx(15.0)
    s = h.loop.stats()
    assert s["admitted"] == s["completed"] == 0 and s["chunk_ms"]["count"] == 0
    assert s["admission"]["admitted"] == 0 and s["admission"]["recorded"] == 0
    assert s["warmup"]["chunks"] == 3
    h2 = Harness()
    h2.loop.warmup(0)
    assert not h2.admission.seeded and h2.engine.resets == 1
    with pytest.raises(ValueError):
        h2.loop.warmup(-1)


def test_deadline_fit_says_when_no_chunk_can_be_admitted():
    """A GPU too slow for the model: the warm-up estimate (15 ms) exceeds deadline - margin (10 ms), the loop says
    so (warm-up figures and stats), and the first live frame is indeed refused."""
    h = Harness()
    assert h.loop.deadline_fit() == {"estimate_ms": None, "budget_ms": 31.0, "fits": None}  # no estimate yet
    fig = h.loop.warmup(2)
    assert fig["estimate_ms"] == pytest.approx(15.0) and fig["budget_ms"] == 31.0 and fig["fits"] is True
    slow = Harness(deadline_ms=12.0, margin_ms=2.0)
    fig = slow.loop.warmup(2)
    assert fig["estimate_ms"] == pytest.approx(15.0) and fig["budget_ms"] == 10.0 and fig["fits"] is False
    assert slow.loop.stats()["deadline_fit"]["fits"] is False
    assert slow.loop.step(frame(1)) == REFUSED
    slow.loop.update(deadline_ms=20.0)  # a longer deadline: fits from the next cycle
    slow.loop.apply_pending_updates()
    assert slow.loop.deadline_fit()["fits"] is True
    slow.clock.t = slow.loop.clock.next_deadline(slow.clock.t)  # a frame at the start of a cycle
    assert slow.loop.step(frame(2)) == ADMITTED


def test_update_validates_now_and_applies_at_the_next_cycle():
    h = Harness()
    h.loop.update(deadline_ms=20.0, ema_alpha=0.9)
    assert h.admission.deadline_ms == 33.0  # not yet
    with pytest.raises(ValueError, match="safety_margin_ms"):
        h.loop.update(safety_margin_ms=25.0)  # would leave no time inside the pending 20 ms deadline
    for bad in ({"deadline_ms": -1.0}, {"saliency_threshold": 3.0}, {"period_ms": 0}, {"period_ms": True},
                {"nope": 1}, {"late_discard_ms": float("nan")}):
        with pytest.raises(ValueError):
            h.loop.update(**bad)
    h.loop.update(period_ms=50.0)
    h.loop.apply_pending_updates()
    assert (h.admission.deadline_ms, h.admission.ema_alpha, h.loop.clock.period_ms) == (20.0, 0.9, 50.0)
    h.clock.advance_ms(25.0)  # 25 ms into the new 50 ms grid: the 20 ms deadline has passed
    assert h.loop.step(frame(1)) == REFUSED


# ---- the real thread ----------------------------------------------------------------------------------------
def wait_for(cond, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.005)
    return cond()


def threaded(period_ms=20.0):
    engine = FakeEngine(encode_ms=0.5, prefill_ms=1.0, decode_ms=1.0, sleep=True)
    buf = DoubleBuffer()
    adm = AdmissionController(deadline_ms=period_ms, safety_margin_ms=1.0)
    actions = []
    events = []
    loop = InferenceLoop(engine, buf, adm, period_ms, on_action=lambda r, f: actions.append(f.frame_id),
                         on_event=lambda k, i: events.append(k), wait_timeout_s=0.02)
    return engine, buf, loop, actions, events


def test_thread_runs_one_chunk_per_cycle_on_the_freshest_frames():
    engine, buf, loop, actions, events = threaded()
    loop.start()
    t0 = time.monotonic()
    try:
        for i in range(1, 61):
            buf.write(frame(i))
            time.sleep(0.004)  # a camera faster than the 20 ms cycle
        assert wait_for(lambda: len(actions) >= 3)
    finally:
        assert loop.stop()
    elapsed_cycles = (time.monotonic() - t0) * 1e3 / 20.0
    assert events[0] == "started" and events[-1] == "stopped"
    assert all(a < b for a, b in zip(actions, actions[1:])), "frames must be processed newest-first, once"
    s = loop.stats()
    assert s["frames_taken"] <= elapsed_cycles + 2  # at most one chunk decision per cycle
    assert s["frames"]["overwritten"] > 0  # the camera outran the cycle: older frames were skipped
    assert not loop.running


def test_pause_resume_and_errors_in_the_thread():
    engine, buf, loop, actions, events = threaded()
    engine.fail[2] = RuntimeError("boom")
    loop.start()
    try:
        buf.write(frame(1))
        assert wait_for(lambda: actions == [1])
        buf.write(frame(2))
        assert wait_for(lambda: loop.errors == 1)
        buf.write(frame(3))
        assert wait_for(lambda: actions == [1, 3])  # recovered after the error
        loop.pause()
        assert wait_for(lambda: loop.paused)
        time.sleep(0.05)  # let the loop notice the pause
        buf.write(frame(4))
        time.sleep(0.1)
        assert actions == [1, 3]  # nothing admitted while paused
        loop.resume()
        buf.write(frame(5))
        assert wait_for(lambda: 5 in actions), (loop.stats()["admission"], loop.stats()["frames"], events)
        assert 4 not in actions  # written before resume: stale, dropped and counted
        assert loop.stats()["dropped_while_paused"] + buf.overwritten >= 1
        assert "chunk_error" in events and "paused" in events and "resumed" in events
    finally:
        assert loop.stop()


def test_frame_refused_for_time_is_retried_at_the_next_cycle_start():
    engine, buf, loop, actions, events = threaded()
    real_decide = loop.admission.decide
    decisions = []

    def refuse_first(time_left_ms, decode_tokens):
        d = real_decide(time_left_ms, decode_tokens)
        if not decisions:
            d = Decision(False, d.estimate_ms, -1.0)  # as if the frame came in at the very end of a cycle
        decisions.append(d)
        return d

    loop.admission.decide = refuse_first
    loop.start()
    try:
        buf.write(frame(1))  # a slow camera: no newer frame follows
        assert wait_for(lambda: actions == [1])
    finally:
        assert loop.stop()
    assert [d.admit for d in decisions] == [False, True]
    assert loop.retried == 1 and loop.refused == 1 and loop.completed == 1


def test_stop_reports_a_hung_chunk_and_in_flight_time():
    engine, buf, loop, actions, events = threaded()
    engine.release.clear()  # the next chunk hangs inside run_chunk
    loop.start()
    try:
        buf.write(frame(1))
        assert engine.in_chunk.wait(10)
        assert wait_for(lambda: loop.in_flight_ms() > 0.0)
        with pytest.raises(RuntimeError):
            loop.warmup(1)  # the engine belongs to the running loop thread
        assert loop.stop(timeout_s=0.05) is False  # cannot pre-empt the hung chunk
        assert loop.running
    finally:
        engine.release.set()
    assert wait_for(lambda: not loop.running)
    assert loop.stop() is True
    assert loop.stats()["deadline_misses"] == 1  # the hung chunk overran its 20 ms deadline
    assert loop.in_flight_ms() == 0.0


def test_loop_thread_alone_runs_at_lower_os_priority():
    import os

    engine = FakeEngine(encode_ms=0.5, prefill_ms=1.0, decode_ms=1.0, sleep=True)
    adm = AdmissionController(deadline_ms=20.0, safety_margin_ms=1.0)
    caller_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    loop = InferenceLoop(engine, DoubleBuffer(), adm, 20.0, on_action=lambda r, f: None, thread_nice=3,
                         wait_timeout_s=0.02)
    loop.start()
    try:
        assert wait_for(lambda: loop.stats()["thread_nice"] is not None)
    finally:
        assert loop.stop()
    assert loop.stats()["thread_nice"] == min(19, caller_nice + 3)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == caller_nice  # other threads untouched
    with pytest.raises(ValueError, match="thread_nice"):
        InferenceLoop(engine, DoubleBuffer(), adm, 20.0, on_action=lambda r, f: None, thread_nice=25)
