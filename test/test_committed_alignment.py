"""Issue 22: the committed prefix of ``blend`` (core/executor.py) and the forced prefix the inference loop decodes
(core/committed_prefix.py) must name, for the new chunk's step j, the executing chunk's step for the SAME control
instant. Frames of a camera synchronised with the control (the sim's camera_after_control) are stamped a whole
number of steps apart plus a little jitter either way; a step index taken by flooring the stamp difference then
falls one step back whenever the new frame is stamped a hair early (about half the chunks in the closed loop): the
"committed" step is one the robot already executed, the executor jumps back to it on arrival and the model is
forced to condition on it. Pure: no ROS, no engine, fake clock."""
import types

import numpy as np
import pytest

from vla_edge_ros.core.committed_prefix import CommittedPrefix, committed_bins
from vla_edge_ros.core.executor import ChunkExecutor

MS = 1_000_000
DT = 200 * MS  # 5 Hz, as in the chunk_compare run
H = 4
S = 10**12  # the executing chunk's frame stamp


def plan(first: int, dims: int = 2) -> np.ndarray:
    """A chunk whose step j is the control instant it is meant for (first + j) in every dimension."""
    return np.repeat(first + np.arange(H, dtype=np.int64)[:, None], dims, axis=1)


@pytest.mark.parametrize("jitter_ns", [-1_000, -500_000, 0, 1_000, 500_000])
def test_blend_keeps_the_step_being_executed_when_the_frame_is_stamped_a_hair_off_the_grid(jitter_ns):
    """RTC's definition: the committed steps are the ones executed while the new chunk was computed, so the
    command cannot change when the chunk arrives (continuity), whichever side of the grid the stamp fell on."""
    ex = ChunkExecutor(action_dims=2, horizon=H, merge="blend", gripper_index=None)
    old = plan(0).astype(np.float64)
    assert ex.offer(old, S, DT, S + 150 * MS)
    new_stamp = S + 2 * DT + jitter_ns  # the frame two control steps later (execution horizon 2)
    arrival = new_stamp + 160 * MS  # latency < one step: d = 1
    before = ex.tick(arrival - 1 * MS)
    assert before.values.tolist() == [2.0, 2.0]  # the executing chunk's step 2 is being played
    assert ex.offer(plan(100).astype(np.float64), new_stamp, DT, arrival)
    after = ex.tick(arrival)
    assert after.values.tolist() == before.values.tolist()  # committed: what was being executed
    assert ex.committed_prefix(new_stamp, 1).tolist() == [[2.0, 2.0]]  # the rewritten chunk's step 0


@pytest.mark.parametrize("jitter_ns", [-1_000, -500_000, 0, 1_000, 500_000])
def test_the_forced_prefix_is_the_executing_chunks_steps_for_the_same_instants(jitter_ns):
    new_stamp = S + 2 * DT + jitter_ns
    rows = committed_bins(plan(0), S, new_stamp, DT, 2)
    assert rows[:, 0].tolist() == [2, 3]  # the new chunk's steps 0, 1 are the old chunk's 2, 3
    ex = ChunkExecutor(action_dims=2, horizon=H, merge="blend", gripper_index=None)
    ex.offer(plan(0).astype(np.float64), S, DT, S)
    np.testing.assert_array_equal(ex.committed_prefix(new_stamp, 2), rows)  # the loop's rule == the executor's


def test_closed_loop_blend_with_a_forced_prefix_executes_every_instant_once():
    """A 5 Hz control grid with timer jitter, a frame stamped after each control step, a chunk every 2 frames
    arriving 160 ms after its frame, a policy that is exactly right (its step j for frame n is control instant
    n + 1 + j, so any mix of plans for one instant is that instant): what the sim applies at control step m must
    be m, and every forced prefix must be the plan for its instants."""
    rng = np.random.default_rng(22)
    n_steps = 60
    control = [m * DT + int(rng.uniform(0, 300_000)) for m in range(n_steps + 4)]  # timer jitter < 0.3 ms
    stamps = [t + int(rng.uniform(1.5 * MS, 3.0 * MS)) for t in control]  # control step + render start
    ex = ChunkExecutor(action_dims=2, horizon=H, merge="blend", gripper_index=None)
    committed = CommittedPrefix(enabled=True, horizon=H)
    events = []  # (time, kind, payload), time-ordered
    for n in range(0, n_steps, 2):
        events.append((stamps[n] + 160 * MS, "chunk", n))
    for m in range(1, n_steps + 1):
        events.append((control[m], "control", m))
    applied, wrong_forced = {}, []
    for t, kind, x in sorted(events):
        if kind == "chunk":
            n = x
            forced = committed.forced_bins(stamps[n], estimate_ms=150.0, safety_margin_ms=2.0, step_ns=DT)
            bins = plan(n + 1)
            if forced is not None:
                if forced[:, 0].tolist() != list(range(n + 1, n + 1 + len(forced))):
                    wrong_forced.append((n, forced[:, 0].tolist()))
                bins[:len(forced)] = forced
            committed.ran(forced)
            ex.offer(bins.astype(np.float64), stamps[n], DT, t)
            committed.delivered(types.SimpleNamespace(chunk_bins=bins), stamps[n])
        else:
            applied[x] = ex.tick(t - 1 * MS).values[0]  # the newest 30 Hz tick before the control step
    assert wrong_forced == []
    assert {m: v for m, v in applied.items() if abs(v - m) > 1e-9} == {}  # the blend ramp mixes m with m
    assert committed.stats()["forced_chunks"] == n_steps // 2 - 1


def test_the_forced_length_counts_the_frames_age_at_receipt():
    """The executor commits ceil((arrival - stamp) / dt) steps; the loop's prediction starts at the chunk's start,
    so a frame that was already 40 ms old when received must count: estimate 190 + margin 2 alone gives d = 1,
    with the age d = 2 (the 100 ms run: 1455 steps forced where the executor kept 1819)."""
    cp = CommittedPrefix(enabled=True, horizon=H)
    cp.delivered(types.SimpleNamespace(chunk_bins=plan(0)), S)
    new_stamp = S + 2 * DT - 1_000
    assert cp.forced_bins(new_stamp, 190.0, 2.0, DT)[:, 0].tolist() == [2]
    assert cp.forced_bins(new_stamp, 190.0, 2.0, DT, frame_age_ms=40.0)[:, 0].tolist() == [2, 3]
    assert cp.forced_bins(new_stamp, 190.0, 2.0, DT, frame_age_ms=-5.0)[:, 0].tolist() == [2]  # skew: ignored


class _Clock:
    def __init__(self):
        self.t = 5_000 * MS

    def __call__(self):
        return self.t


class _Engine:
    """Bins = the frame's first control instant + step; forced steps kept; records forced_bins; 190 ms a chunk."""

    def __init__(self, clock):
        self.clock, self.forced = clock, []

    def encode_frame(self, image):
        return np.ones((4, 3), np.float32)

    def run_chunk(self, tokens, frame_id, salient=False, forced_bins=None):
        from vla_edge_ros.engine.interface import ChunkResult
        self.forced.append(None if forced_bins is None else forced_bins[:, 0].tolist())
        self.clock.t += 190 * MS
        bins = plan(frame_id)
        if forced_bins is not None:
            bins[:len(forced_bins)] = forced_bins
        return ChunkResult(frame_id, np.zeros(1, np.int64), bins[0], bins[0].astype(np.float32), 10.0, 180.0,
                           190.0, chunk=bins.astype(np.float32), chunk_bins=bins)

    def reset(self):
        pass


def test_the_loop_passes_the_frames_age_and_aligns_a_jittered_stamp():
    from vla_edge_ros.core.admission import AdmissionController
    from vla_edge_ros.core.double_buffer import DoubleBuffer
    from vla_edge_ros.core.inference_loop import InferenceLoop

    clock = _Clock()
    eng = _Engine(clock)
    adm = AdmissionController(deadline_ms=400.0, safety_margin_ms=2.0, ema_alpha=0.2)
    adm.seed(10.0, 180.0 / 8)  # estimate 190 ms
    loop = InferenceLoop(eng, DoubleBuffer(), adm, 200.0, on_action=lambda *_: None, decode_tokens=8,
                         time_ns=clock, action_horizon=H, execution_horizon_steps=2, force_committed_steps=True)
    frame = lambda fid, stamp, age_ms: types.SimpleNamespace(  # noqa: E731
        frame_id=fid, stamp_ns=stamp, received_ns=stamp + int(age_ms * MS), image=np.zeros((2, 2, 3), np.uint8))
    assert loop.step(frame(1, S, 40.0)) == "admitted"
    clock.t += 400 * MS
    assert loop.step(frame(3, S + 2 * DT - 1_000, 40.0)) == "admitted"  # a hair early, 40 ms old on receipt
    assert eng.forced == [None, [3, 4]]  # plan(1)'s steps 2, 3: instants 3 and 4, both committed
