"""Two ways of decoding an action chunk beyond plain greedy (issue 22): a forced committed prefix and parallel slots.

Forced prefix (``run_chunk(forced_bins=(d, action_dims))``): the first d steps are the given bins, fed as inputs
(teacher forcing), the rest greedy; the numpy engine (speculative drafts: forced tokens are drafted and always
accepted) must equal the reference for every d in 0..H in both chunk shapes; bad forced_bins are refused with the
reason; the inference loop forces what ChunkExecutor.committed_prefix says the robot has committed.
Parallel (``vla.chunk_decode: parallel``): one pass over the A action slots, bidirectional among them; the numpy
engine and its fleet equal the reference over streams with evictions; a causal mask would fail the attention test.
The CUDA backend does both too (test/test_cuda_chunk_modes.py, against the numpy engine). Numbers that pin the
layout are written out, not computed with geometry.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from test_chunk_horizon import INSTRUCTION, cfg_dict, cfg_for, frames, kv_for
from test_fleet_numpy import Fleet
from test_numpy_engine import random_weights
from vla_edge_ros.core.admission import AdmissionController
from vla_edge_ros.core.double_buffer import DoubleBuffer
from vla_edge_ros.core.executor import ChunkExecutor
from vla_edge_ros.core.inference_loop import InferenceLoop
from vla_edge_ros.engine import geometry
from vla_edge_ros.engine import reference as R
from vla_edge_ros.engine.checkpoint import write_checkpoint
from vla_edge_ros.engine.factory import make_engine
from vla_edge_ros.engine.fault_injection import FaultInjectingEngine
from vla_edge_ros.engine.interface import ChunkResult, EngineError
from vla_edge_ros.engine.numpy_backend import NumpyEngine

DIMS, H = 7, 4
MS = 1_000_000


def pair(cfg, seed=3, speculative=True):
    w = random_weights(cfg, seed=seed)
    eng = NumpyEngine(cfg, w, kv_for(cfg), instruction=INSTRUCTION)
    eng.speculative = speculative
    return eng, R.start_stream(cfg, w, kv_for(cfg), INSTRUCTION)


def assert_same(eng, res, ref, where):
    assert res.evicted_frames == ref.evicted, where
    scale = 1.0 + np.abs(ref.logits).max()
    err = np.abs(eng.last_logits - ref.logits).max() / scale
    assert err < 2e-5, f"{where}: logits differ from the reference by {err:.2e}"
    assert np.array_equal(res.token_ids, ref.token_ids), where
    np.testing.assert_array_equal(res.chunk_bins, ref.chunk_bins)
    np.testing.assert_array_equal(res.chunk, ref.chunk)


# ---- forced prefix ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("speculative", [True, False])
@pytest.mark.parametrize("start", ["token", "prefill"])
def test_a_forced_prefix_equals_the_reference_for_every_d(start, speculative):
    cfg = cfg_for(H, start)
    eng, stream = pair(cfg, speculative=speculative)
    rng = np.random.default_rng(11)
    first, off = (0 if start == "prefill" else 1), cfg.action_token_offset
    evicted = 0
    for fid, tok in enumerate(frames(2 * (H + 1), cfg.hidden_size, seed=12)):  # budget 3 frames: FIFO evicts
        d = fid % (H + 1)  # 0, 1, .., H, 0, 1, ..
        forced = rng.integers(0, cfg.n_action_bins, size=(d, DIMS))
        res, ref = eng.run_chunk(tok, fid, forced_bins=forced), R.reference_chunk(stream, tok, fid, forced_bins=forced)
        assert_same(eng, res, ref, f"{start} frame {fid} d={d}")
        evicted += len(ref.evicted)
        assert res.forced_steps == ref.forced_steps == d
        np.testing.assert_array_equal(res.chunk_bins[:d], forced)  # verbatim
        np.testing.assert_array_equal(res.token_ids[first:first + d * DIMS], forced.ravel() + off)
        # every entry after the forced ones is the greedy choice of its own row's logits
        free = np.arange(first + d * DIMS, len(res.token_ids))
        np.testing.assert_array_equal(res.token_ids[free], np.argmax(ref.logits[free], axis=1) + off)
        if speculative and d == H and start == "token":
            assert eng.last_decode_passes == 1  # the whole prefix drafted and accepted in one pass
    assert evicted >= 5


def test_the_rest_is_the_greedy_decode_conditioned_on_the_forced_steps():
    """Forcing the decode's own choices changes nothing; forcing other bins changes the later steps (they are
    fed as inputs, not just pasted over the result)."""
    cfg = cfg_for(H, "token")
    w = random_weights(cfg, seed=5)
    tok = frames(1, cfg.hidden_size, seed=6)[0]

    def run(forced):
        return R.reference_chunk(R.start_stream(cfg, w, kv_for(cfg), INSTRUCTION), tok, 0, forced_bins=forced)

    plain = run(None)
    for d in range(H + 1):
        own = run(plain.chunk_bins[:d])
        np.testing.assert_array_equal(own.token_ids, plain.token_ids)
        assert own.forced_steps == d
    other = (plain.chunk_bins[:1] + 128) % cfg.n_action_bins
    forced = run(other)
    np.testing.assert_array_equal(forced.chunk_bins[:1], other)
    np.testing.assert_allclose(forced.logits[:2], plain.logits[:2])  # up to the first forced bin's own row
    assert not np.allclose(forced.logits[DIMS + 1:], plain.logits[DIMS + 1:]), \
        "the later rows did not change: the forced bins were not fed as inputs"
    eng = NumpyEngine(cfg, w, kv_for(cfg), instruction=INSTRUCTION)
    wrapped = FaultInjectingEngine(eng, "raise@1000", log=lambda *_: None)  # passes forced_bins through
    res = wrapped.run_chunk(tok, 0, forced_bins=other)
    assert res.forced_steps == 1 and np.array_equal(res.token_ids, forced.token_ids)


@pytest.mark.parametrize("bad, why", [
    (np.zeros((1, 6), np.int64), r"shape \(d, action_dims=7\), got \(1, 6\)"),
    (np.zeros(7, np.int64), r"shape \(d, action_dims=7\), got \(7,\)"),
    (np.zeros((1, 7)), "integer action bins, got dtype float64"),
    (np.zeros((1, 7), bool), "integer action bins, got dtype bool"),
    (np.zeros((5, 7), np.int64), "5 steps, more than the chunk's action_horizon 4"),
    (np.full((2, 7), 3, np.int64) - np.eye(2, 7, 3, dtype=np.int64) * 4, r"\[0, 256\): step 0, dimension 3 is -1"),
    (np.full((1, 7), 256, np.int64), r"\[0, 256\): step 0, dimension 0 is 256"),
])
def test_bad_forced_bins_are_refused_with_the_reason_before_the_cache_is_touched(bad, why):
    cfg = cfg_for(H, "token")
    eng, stream = pair(cfg)
    tok = frames(1, cfg.hidden_size, seed=2)[0]
    with pytest.raises(ValueError, match=why):
        eng.run_chunk(tok, 0, forced_bins=bad)
    with pytest.raises(ValueError, match=why):
        R.reference_chunk(stream, tok, 0, forced_bins=bad)
    assert eng.kv.frames == [] and eng.run_chunk(tok, 1).forced_steps == 0


# ---- the inference loop forces what the executor has committed --------------------------------------------------

class _Clock:
    def __init__(self):
        self.t = 5_000 * MS

    def __call__(self):
        return self.t


class _ChunkEngine:
    """Fake engine: bins 10 * frame + step (mod 256) in every dimension, forced steps kept; records forced_bins."""

    name = "fake"
    needs_reset = False

    def __init__(self, clock, refuse_forcing=False):
        self.clock, self.refuse_forcing, self.calls, self.results = clock, refuse_forcing, [], []

    def encode_frame(self, image):
        return np.ones((4, 3), np.float32)

    def run_chunk(self, tokens, frame_id, salient=False, **kw):
        self.calls.append(kw)
        forced = kw.get("forced_bins")
        if forced is not None and self.refuse_forcing:
            raise EngineError("forced_bins: refused")
        self.clock.t += 4 * MS
        bins = (10 * (frame_id % 25) + np.arange(H)[:, None] + np.zeros((1, DIMS), np.int64)) % 256
        if forced is not None:
            bins[:len(forced)] = forced
        self.results.append(ChunkResult(frame_id, np.zeros(1, np.int64), bins[0], bins[0].astype(np.float32), 1.0,
                                        3.0, 4.0, chunk=bins.astype(np.float32), chunk_bins=bins))
        return self.results[-1]

    def reset(self):
        pass


class _Frame:
    def __init__(self, fid, stamp_ns):
        self.frame_id, self.stamp_ns, self.image = fid, stamp_ns, np.zeros((2, 2, 3), np.uint8)


def loop_for(engine, clock, period_ms, force=True, horizon=H, seed=(10.0, 2.0)):
    adm = AdmissionController(deadline_ms=200.0, safety_margin_ms=3.0, ema_alpha=0.2)
    adm.seed(*seed)
    return InferenceLoop(engine, DoubleBuffer(), adm, period_ms, on_action=lambda *_: None, decode_tokens=2,
                         time_ns=clock, action_horizon=horizon, execution_horizon_steps=1,
                         force_committed_steps=force)


@pytest.mark.parametrize("period_ms, offset_steps, seed", [  # estimate about 12 ms (+ margin 3) after chunk 1
    (20.0, 1.0, (10.0, 2.0)),  # d = 1
    (10.0, 1.5, (10.0, 2.0)),  # d = 2, a frame between two steps: the step in effect mid-window
    (5.0, 0.0, (10.0, 2.0)),  # d = 3
    (5.0, 2.0, (10.0, 2.0)),  # d = 3, but the executing chunk runs out after 2
    (2.0, 1.0, (30.0, 5.0)),  # d clipped to H
    (10.0, 5.0, (10.0, 2.0)),  # the executing chunk has run out: nothing forced
])
def test_the_loop_forces_the_prefix_the_executor_commits(period_ms, offset_steps, seed):
    clock = _Clock()
    eng = _ChunkEngine(clock)
    loop = loop_for(eng, clock, period_ms, seed=seed)
    step_ns = int(round(period_ms * MS))
    s1 = 10**12
    s2 = s1 + int(offset_steps * step_ns)
    assert loop.step(_Frame(1, s1)) == "admitted" and eng.calls[-1] == {}  # nothing delivered yet
    prev_bins = eng.results[-1].chunk_bins
    estimate = loop.admission.estimate_ms(loop.decode_tokens)
    d = min(H, math.ceil((estimate + 3.0) / period_ms))
    executor = ChunkExecutor(action_dims=DIMS, horizon=H, merge="blend")
    assert executor.offer(prev_bins.astype(np.float64), s1, step_ns, s1)
    committed = executor.committed_prefix(s2, d)
    clock.t += step_ns
    assert loop.step(_Frame(2, s2)) == "admitted"
    forced = eng.calls[-1].get("forced_bins")
    if len(committed) == 0:
        assert forced is None
    else:
        np.testing.assert_array_equal(forced, committed)
        assert forced.dtype == np.int64
    stats = loop.stats()["committed_prefix"]
    assert stats == {"enabled": True, "forced_chunks": int(len(committed) > 0), "forced_steps": len(committed)}


def test_expected_prefixes_written_out():
    """The executor's rule by hand: period 10 ms, frame 1.5 steps later, d = 2: the old chunk's steps in effect
    in the middle of the new steps' windows (15-25 ms, 25-35 ms: at 20 and 30 ms), steps 2 and 3 (issue 22: read
    at the windows' start, a frame stamped a hair early would name steps the robot has already executed)."""
    clock = _Clock()
    eng = _ChunkEngine(clock)
    loop = loop_for(eng, clock, 10.0)
    loop.step(_Frame(1, 10**12))
    clock.t += 10 * MS
    loop.step(_Frame(2, 10**12 + 15 * MS))
    np.testing.assert_array_equal(eng.calls[-1]["forced_bins"][:, 0], [12, 13])


@pytest.mark.parametrize("force, horizon", [(False, H), (True, 1)])
def test_no_forcing_when_off_or_single_step(force, horizon):
    clock = _Clock()
    eng = _ChunkEngine(clock)
    loop = loop_for(eng, clock, 5.0, force=force, horizon=horizon)
    for i in range(3):
        loop.step(_Frame(i + 1, 10**12 + i * 5 * MS))
        clock.t += 5 * MS
    assert eng.calls == [{}, {}, {}] and loop.stats()["committed_prefix"]["forced_chunks"] == 0


def test_resume_forgets_the_executing_chunk_and_warmup_surfaces_a_refusal():
    clock = _Clock()
    eng = _ChunkEngine(clock)
    loop = loop_for(eng, clock, 5.0)
    loop.step(_Frame(1, 10**12))
    loop.resume()  # the action side held while paused: nothing is executing
    loop.step(_Frame(2, 10**12 + 5 * MS))
    assert eng.calls[-1] == {}
    refusing = _ChunkEngine(_Clock(), refuse_forcing=True)
    with pytest.raises(EngineError, match="forced_bins"):
        loop_for(refusing, refusing.clock, 5.0).warmup(2)
    assert "forced_bins" in refusing.calls[1] and refusing.calls[0] == {}
    with pytest.raises(ValueError, match="force_committed_steps must be true or false"):
        loop_for(eng, clock, 5.0, force="yes")


# ---- parallel decoding ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("horizon, slots", [(1, 7), (4, 28)])
def test_parallel_numpy_equals_the_reference_with_eviction(horizon, slots):
    cfg = cfg_for(horizon, "token", chunk_decode="parallel")
    assert geometry.chunk_decode_steps(cfg, 8) == 1 and geometry.chunk_scratch_slots(cfg, 8) == slots
    assert geometry.parallel_slot_token(cfg) == cfg.vocab_size - 256  # bin 0's id
    eng, stream = pair(cfg)
    assert (eng.decode_steps, eng.scratch_slots) == (1, slots) and eng.k_pre.shape[1] == eng.capacity + slots
    evicted = 0
    for fid, tok in enumerate(frames(6, cfg.hidden_size, seed=21)):
        forced = np.full((1, DIMS), 9, np.int64) if fid == 4 else None
        res, ref = eng.run_chunk(tok, fid, forced_bins=forced), R.reference_chunk(stream, tok, fid, forced_bins=forced)
        assert_same(eng, res, ref, f"parallel H={horizon} frame {fid}")
        evicted += len(ref.evicted)
        assert res.token_ids.shape == (slots + 1,) and res.chunk_bins.shape == (horizon, DIMS)
        assert eng.last_decode_passes == 1 and eng.last_max_position == eng.kv.occupancy_tokens + slots - 1
        np.testing.assert_array_equal(res.chunk_bins.ravel(), res.token_ids[1:] - cfg.action_token_offset)
        assert res.forced_steps == (1 if fid == 4 else 0)
        if fid == 4:
            np.testing.assert_array_equal(res.chunk_bins[0], 9)
    assert evicted == 3


def test_parallel_slots_attend_bidirectionally(monkeypatch):
    """Perturb the LAST slot's input embedding: the FIRST slot's logits change (a causal mask would hide it),
    in the numpy engine and in the reference alike; the prefill's row does not."""
    cfg = cfg_for(H, "token", chunk_decode="parallel")
    w = random_weights(cfg, seed=8)
    tok = frames(1, cfg.hidden_size, seed=9)[0]
    a = 28
    plain = NumpyEngine(cfg, w, kv_for(cfg), instruction=INSTRUCTION)
    plain.run_chunk(tok, 0)
    bumped = NumpyEngine(cfg, w, kv_for(cfg), instruction=INSTRUCTION)
    forward = bumped._forward_tokens

    def perturbed(x, *args, **kw):
        if len(x) == a:
            x = x.copy()
            x[-1] += 0.5
        return forward(x, *args, **kw)

    bumped._forward_tokens = perturbed
    bumped.run_chunk(tok, 0)
    np.testing.assert_allclose(bumped.last_logits[0], plain.last_logits[0], rtol=1e-6)
    assert np.abs(bumped.last_logits[1] - plain.last_logits[1]).max() > 1e-4

    stream = R.start_stream(cfg, w, kv_for(cfg), INSTRUCTION)
    ref_plain = R.reference_chunk(R.start_stream(cfg, w, kv_for(cfg), INSTRUCTION), tok, 0)
    embed = R.embed

    def bumped_embed(weights, ids):
        e = embed(weights, ids)
        if len(ids) == a:
            e = e.copy()
            e[-1] += 0.5
        return e

    monkeypatch.setattr(R, "embed", bumped_embed)
    ref_bumped = R.reference_chunk(stream, tok, 0)
    assert np.abs(ref_bumped.logits[1] - ref_plain.logits[1]).max() > 1e-4
    err = np.abs(bumped.last_logits - ref_bumped.logits).max() / (1.0 + np.abs(ref_bumped.logits).max())
    assert err < 2e-5


def test_the_fleet_decodes_parallel_chunks_like_each_robot_alone():
    fleet = Fleet(cfg_for(H, "token", chunk_decode="parallel"), ["a", "b", "c"])
    assert fleet.engine.decode_steps == 1 and fleet.engine.scratch_slots == 28
    for _ in range(5):  # budgets of 3 / 2 / 4 frames: every robot evicts
        fleet.cycle(["a", "b", "c"])
    fleet.cycle(["b"])
    assert all(eng.last_decode_passes == 1 for eng in fleet.twins.values())


def test_parallel_needs_the_token_start_and_is_refused_with_prefill_by_name(tmp_path):
    cfg = cfg_for(H, "prefill", chunk_decode="parallel")
    why = r"vla.chunk_decode='parallel' with vla.action_start='prefill'"
    with pytest.raises(EngineError, match=why):
        geometry.chunk_decode_steps(cfg, 8)
    with pytest.raises(EngineError, match=why):
        NumpyEngine(cfg, random_weights(cfg), kv_for(cfg), instruction=INSTRUCTION)
    ckpt = write_checkpoint(tmp_path / "p", cfg_dict(H, "prefill", chunk_decode="parallel"), random_weights(cfg))
    with pytest.raises(EngineError, match=why):
        make_engine({"backend": "numpy", "checkpoint": str(ckpt), "instruction": INSTRUCTION}, log=lambda *_: None)
