"""Admission with action chunks: ChunkSchedule (pure: when the next chunk starts, its deadline) and the
InferenceLoop running chunks of H = 4 on a fake clock; H = 1 is today's single-step loop."""
import numpy as np
import pytest

from test_inference_loop import ADMITTED, REFUSED, FakeEngine, Frame, Harness, frame  # the loop's fake engine / clock

from vla_edge_ros.core.admission import CycleClock
from vla_edge_ros.core.chunk_schedule import ChunkSchedule, horizon_problem
from vla_edge_ros.engine.interface import ChunkResult

MS = 1_000_000
STEP = 33 * MS


@pytest.mark.parametrize("deadline_ms, period_ms", [(33.0, 33.0), (20.0, 50.0), (100.0, 33.0)])
def test_horizon_1_is_the_single_step_deadline_and_every_cycle(deadline_ms, period_ms):
    clock = CycleClock(period_ms, start_ns=7 * MS)
    sched = ChunkSchedule(1, 0)
    step = int(period_ms * MS)
    for now in (7 * MS, 30 * MS, 123 * MS, 10_000 * MS + 3):
        start = clock.cycle_start(now)
        assert sched.deadline_ns(start, deadline_ms, step) == clock.deadline_ns(now, deadline_ms)
        for executing in (None, start, start - step, start - 5 * step):
            assert sched.due(start, executing, step)
    assert (sched.execution_steps, sched.overlap_steps, sched.overlaps) == (1, 0, False)
    assert sched.deadline_ms(deadline_ms, period_ms) == deadline_ms


def test_overlapping_chunks_start_after_the_execution_horizon_and_are_due_when_the_executing_one_runs_out():
    sched = ChunkSchedule(8, 3)
    c0 = 1_000 * MS  # the executing chunk's cycle start
    assert [sched.due(c0 + k * STEP, c0, STEP) for k in range(6)] == [False, False, False, True, True, True]
    start = c0 + 3 * STEP
    # the executing chunk's last step ends at c0 + 8 steps = 5 steps after this start; longer than deadline_ms
    assert sched.deadline_ns(start, 33.0, STEP) == c0 + 8 * STEP == start + 5 * STEP
    assert sched.deadline_ms(33.0, 33.0) == pytest.approx(165.0)
    # never less than the single-step deadline, however short the overlap
    assert ChunkSchedule(8, 7).deadline_ns(start, 50.0, STEP) == start + 50 * MS
    assert sched.due(start, None, STEP)  # nothing executing (first chunk, after a hold): start now


def test_default_execution_horizon_is_half_the_chunk_and_h_is_synchronous():
    assert [ChunkSchedule(h).execution_steps for h in (1, 2, 3, 8, 9)] == [1, 1, 2, 4, 5]
    sync = ChunkSchedule(4, 4)
    assert not sync.overlaps and sync.deadline_ns(0, 33.0, STEP) == 33 * MS  # as single step: no plan covers it
    assert [sync.due(k * STEP, 0, STEP) for k in range(6)] == [False, False, False, False, True, True]


def test_a_restarted_grid_rounds_to_the_nearest_cycle():
    sched = ChunkSchedule(8, 2)
    assert sched.due(2 * STEP - STEP // 2, 0, STEP)  # a new grid half a step early still counts 2 steps
    assert not sched.due(2 * STEP - STEP // 2 - 1, 0, STEP)


@pytest.mark.parametrize("h, e, match", [(0, 0, "action_horizon"), (4, 5, "exceeds"), (4, -1, ">= 0"),
                                         (4, True, "integer"), (2.0, 1, "integer"), (4, 1.5, "integer")])
def test_bad_horizons_are_refused_with_the_reason(h, e, match):
    assert match in horizon_problem(h, e)
    with pytest.raises(ValueError, match=match):
        ChunkSchedule(h, e)
    with pytest.raises(ValueError, match="exceeds"):
        ChunkSchedule(4, 1).set_execution_horizon(9)


class ChunkEngine(FakeEngine):
    """The loop's fake engine, returning (H, 7) chunks whose rows name the frame and the step."""

    def __init__(self, clock, horizon=4, **kw):
        super().__init__(clock, **kw)
        self.horizon = horizon

    def run_chunk(self, vision_tokens, frame_id, salient=False):
        r = super().run_chunk(vision_tokens, frame_id, salient)
        r.chunk = (frame_id + np.arange(self.horizon, dtype=np.float32)[:, None] / 10) * np.ones((1, 7), np.float32)
        return r


def chunk_harness(horizon=4, execution_horizon_steps=2, prefill_ms=6.0, decode_ms=8.0):
    h = Harness(action_horizon=horizon, execution_horizon_steps=execution_horizon_steps)
    h.engine = ChunkEngine(h.clock, horizon, prefill_ms=prefill_ms, decode_ms=decode_ms)
    h.loop.engine = h.engine
    return h


def test_loop_delivers_the_chunk_with_its_frame_stamp():
    h = chunk_harness()
    assert h.loop.step(frame(3)) == ADMITTED
    (result, f), = h.actions
    assert result.chunk.shape == (4, 7) and result.frame_stamp_ns == f.stamp_ns == 3 * 33 * MS
    np.testing.assert_allclose(result.chunk[:, 0], [3.0, 3.1, 3.2, 3.3])
    assert h.loop.stats()["chunk_schedule"] == {"action_horizon": 4, "execution_horizon_steps": 2,
                                                "execution_steps": 2, "overlap_steps": 2, "step_ms": 33.0}


def test_a_chunk_slower_than_deadline_ms_is_admitted_when_the_executing_chunk_covers_it():
    # 50 ms chunks against deadline_ms 33: single step refuses them, H = 4 / e = 2 gives 2 * 33 ms
    for horizon, e, want in ((1, 0, REFUSED), (4, 4, REFUSED), (4, 2, ADMITTED)):
        h = chunk_harness(horizon, e, prefill_ms=41.0)
        h.admission.seed(42.0, 1.0)  # 50 ms estimate (encode counts as prefill)
        assert h.loop.step(frame(1)) == want, (horizon, e)
        if want == ADMITTED:
            assert h.loop.deadline_misses == 0 and h.loop.deadline_fit()["budget_ms"] == pytest.approx(64.0)
        else:
            assert h.loop.deadline_fit()["budget_ms"] == pytest.approx(31.0)


def test_loop_thread_skips_the_cycles_before_the_execution_horizon():
    h = chunk_harness(horizon=4, execution_horizon_steps=2)
    h.loop.update(execution_horizon_steps=3)  # queued, applied at the next cycle
    h.loop.apply_pending_updates()
    served, c0 = [], h.clock.t
    for k in range(7):  # the loop thread's cycle, without the thread: cycle start -> due? -> step
        h.clock.t = c0 + k * 33 * MS
        if h.loop._chunk_due():
            served.append(k)
            assert h.loop.step(frame(k)) == ADMITTED
    assert served == [0, 3, 6] and h.loop.cycles_not_due == 4
    with pytest.raises(ValueError, match="exceeds"):
        h.loop.update(execution_horizon_steps=5)
    h.loop.resume()  # the action side held while paused: nothing executes, the next cycle starts a chunk
    assert h.loop._chunk_due()


def chunk_harness_5hz(step_ms=200.0):
    """H = 4, e = 2 at 30 Hz cycles, the policy's steps 200 ms (a 5 Hz policy, chunk_step_hz), fast chunks."""
    h = Harness(action_horizon=4, execution_horizon_steps=2, deadline_ms=180.0, step_ms=step_ms)
    h.engine = ChunkEngine(h.clock, 4, prefill_ms=6.0, decode_ms=8.0)
    h.loop.engine = h.engine
    return h


def test_a_policy_step_period_apart_from_the_cycles_sets_the_chunk_deadline():
    h = chunk_harness_5hz()
    # overlap 2 steps of 200 ms (not of the 33 ms cycle) minus the 2 ms margin
    assert h.loop.deadline_fit()["budget_ms"] == pytest.approx(398.0)
    assert h.loop.stats()["chunk_schedule"]["step_ms"] == 200.0
    h.loop.update(step_ms=100.0)
    h.loop.apply_pending_updates()
    assert h.loop.deadline_fit()["budget_ms"] == pytest.approx(198.0)
    with pytest.raises(ValueError, match="step_ms must be a positive"):
        h.loop.update(step_ms=0.0)


def test_a_camera_slower_than_the_cycles_starts_the_next_chunk_when_its_frame_arrives():
    """5 Hz frames (stamped every 200 ms, each arriving 30 ms after its stamp), 33 ms cycles, e = 2 steps of 200
    ms: the next chunk is due at the first cycle after the frame stamped 2 steps after the executing chunk's
    frame arrives, not at the cycle 2 steps after the executing chunk's cycle (when only a frame one step older
    than wanted, already ~170 ms old, exists)."""

    h = chunk_harness_5hz()
    img = np.full((8, 8, 3), 100, np.uint8)
    t0 = 10_000 * MS
    frames = [Frame(img, stamp_ns=t0 + k * 200 * MS, received_ns=t0 + k * 200 * MS + 30 * MS, frame_id=k)
              for k in range(5)]
    started = []
    for c in range(int(900 / 33)):  # cycles from t0 + 30 ms
        now = t0 + 30 * MS + c * 33 * MS
        h.clock.t = now
        for f in frames:  # the camera writes every frame received by now
            if f.received_ns <= now and (h.buffer.peek() is None or h.buffer.peek().frame_id < f.frame_id):
                h.buffer.write(f)
        if h.loop._chunk_due():
            f = h.buffer.read_latest()
            if f is not None:
                assert h.loop.step(f) == ADMITTED
                started.append((f.frame_id, (now - f.stamp_ns) // MS))
    # frame 0 at once; then frame 2 (400 ms later), then frame 4, each started within a cycle of its arrival
    assert [fid for fid, _ in started] == [0, 2, 4]
    assert all(age <= 30 + 33 for _, age in started), started
    # without stamps the cycle rule applies: due 2 steps after the executing chunk's cycle
    h2 = chunk_harness_5hz()
    h2.clock.t = t0
    assert h2.loop.step(Frame(img, stamp_ns=0, received_ns=t0, frame_id=0)) == ADMITTED
    h2.buffer.write(Frame(img, stamp_ns=0, received_ns=t0, frame_id=1))
    cyc0 = h2.loop.clock.cycle_start(t0)
    h2.clock.t = cyc0 + 300 * MS - 1
    assert not h2.loop._chunk_due()
    h2.clock.t = cyc0 + 300 * MS + 33 * MS
    assert h2.loop._chunk_due()


def test_chunk_result_built_with_one_action_is_a_chunk_of_one():
    r = ChunkResult(1, np.zeros(9, np.int64), np.zeros(7, np.int64), np.arange(7, dtype=np.float32), 1.0, 1.0, 2.0)
    assert r.chunk.shape == (1, 7) and r.horizon == 1 and np.array_equal(r.chunk[0], r.action)
    assert r.frame_stamp_ns == 0


def test_the_loop_thread_starts_a_chunk_every_execution_horizon():
    import threading
    import time

    from vla_edge_ros.core.admission import AdmissionController
    from vla_edge_ros.core.double_buffer import DoubleBuffer
    from vla_edge_ros.core.inference_loop import InferenceLoop

    engine = ChunkEngine(None, 4, encode_ms=0.5, prefill_ms=1.0, decode_ms=1.0, sleep=True)
    buf, cycles = DoubleBuffer(), []
    loop = InferenceLoop(engine, buf, AdmissionController(deadline_ms=20.0, safety_margin_ms=1.0), 20.0,
                         on_action=lambda r, f: cycles.append(loop.clock.cycle_index(time.monotonic_ns())),
                         wait_timeout_s=0.02, action_horizon=4, execution_horizon_steps=3)
    stop = threading.Event()

    def camera():  # faster than the 20 ms cycle: a fresh frame is always there, stamped when taken
        i = 0
        while not stop.is_set():
            i += 1
            now = time.monotonic_ns()
            buf.write(Frame(frame(i).image, stamp_ns=now, received_ns=now, frame_id=i))
            time.sleep(0.004)

    cam = threading.Thread(target=camera)
    cam.start()
    loop.start()
    try:
        deadline = time.monotonic() + 20.0
        while len(cycles) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        assert loop.stop()
        stop.set()
        cam.join(5)
    assert len(cycles) >= 5, cycles
    gaps = [b - a for a, b in zip(cycles, cycles[1:])]
    assert min(gaps) >= 3, gaps  # never before the executing chunk played 3 steps (a late start may add one)
    assert loop.stats()["cycles_not_due"] >= 2 * (len(cycles) - 1)
