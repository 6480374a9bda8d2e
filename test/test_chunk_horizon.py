"""Action chunks of H = vla.action_horizon > 1 actions, decoded autoregressively (issue 22, engine side).

The layout (engine/interface.py): A = H * action_dims action tokens, time-major; "token" shape: gen[0] is the
action-start token, S = max(decode_tokens, A + 1) decode steps (the bins and the end token), bins = gen[1..A];
"prefill" shape: gen[0] is bin 1, S = A - 1, bins = gen[0..A-1]. H = 1 keeps S = decode_tokens. The numpy engine
(speculative drafts, slot cache, rotation offset) must equal the plain reference forward for H = 2 and 4 in both
shapes over a stream with evictions; S (``decode_steps``), not decode_tokens, sizes the scratch and the position
check; ``chunk_decode: parallel`` is accepted by both backends up to 32 action slots (decoded by numpy:
test/test_chunk_decode_modes.py; by CUDA: test/test_cuda_chunk_modes.py), wider only by numpy; the inference loop is
handed the real step count.
The numbers below are written out, not computed with engine/geometry.py: they pin its arithmetic.
"""
from __future__ import annotations

import numpy as np
import pytest

from test_numpy_engine import random_weights  # non-degenerate weights (tied head)
from vla_edge_ros.core.admission import AdmissionController
from vla_edge_ros.core.double_buffer import DoubleBuffer
from vla_edge_ros.core.inference_loop import InferenceLoop
from vla_edge_ros.core.kv.manager import KVManager
from vla_edge_ros.engine import geometry
from vla_edge_ros.engine import reference as R
from vla_edge_ros.engine.checkpoint import write_checkpoint
from vla_edge_ros.engine.config import ModelConfig, tiny_default_dict
from vla_edge_ros.engine.cuda.engine import CudaEngine, unsupported_reason
from vla_edge_ros.engine.factory import make_engine
from vla_edge_ros.engine.fault_injection import FaultInjectingEngine
from vla_edge_ros.engine.interface import ChunkResult, EngineError
from vla_edge_ros.engine.numpy_backend import NumpyEngine

INSTRUCTION = "pick up"  # 7 byte tokens
TPF = 32
DIMS = 7


def cfg_dict(horizon=1, action_start="token", max_pos=1024, **vla):
    d = tiny_default_dict()
    d.update(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, max_position_embeddings=max_pos, rope_theta=10000.0)
    d["vla"].update(action_horizon=horizon, action_start=action_start, **vla)
    return d


def cfg_for(horizon=1, action_start="token", **kw):
    return ModelConfig.from_json(cfg_dict(horizon, action_start, **kw))


def kv_for(cfg, frames=3, budget=None):
    P = len(INSTRUCTION.encode())
    budget = -(-(P + frames * TPF) // TPF) * TPF if budget is None else budget
    return KVManager(budget, TPF, P, policy="fifo", embed_dim=cfg.hidden_size)


def frames(n, hidden, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((TPF, hidden)).astype(np.float32) for _ in range(n)]


# ---- the layout's numbers ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("horizon, start, decode_tokens, steps", [
    (1, "token", 8, 8), (1, "token", 12, 12), (1, "token", 7, 7),  # H = 1: decode_tokens, unchanged
    (1, "prefill", 8, 6),
    (2, "token", 8, 15), (4, "token", 8, 29), (4, "token", 40, 40),  # max(decode_tokens, A + 1)
    (2, "prefill", 8, 13), (4, "prefill", 8, 27), (4, "prefill", 40, 27),  # A - 1 whatever decode_tokens says
])
def test_decode_steps_follow_the_layout_on_the_engine(horizon, start, decode_tokens, steps):
    cfg = cfg_for(horizon, start)
    assert geometry.chunk_decode_steps(cfg, decode_tokens) == steps
    eng = NumpyEngine(cfg, random_weights(cfg), kv_for(cfg), instruction=INSTRUCTION, decode_tokens=decode_tokens)
    assert (eng.decode_steps, eng.decode_tokens) == (steps, decode_tokens)
    assert eng.k_pre.shape[1] == eng.capacity + steps  # the scratch slots are S, not decode_tokens
    first = 0 if start == "prefill" else 1
    assert geometry.action_token_slice(cfg) == slice(first, first + horizon * DIMS)
    r = eng.run_chunk(frames(1, cfg.hidden_size, seed=2)[0], 0)
    assert r.token_ids.shape == (steps + 1,) and eng.last_logits.shape == (steps + 1, cfg.n_action_bins)
    assert r.chunk.shape == (horizon, DIMS) and r.chunk_bins.shape == (horizon, DIMS)
    assert eng.last_max_position == eng.kv.occupancy_tokens + steps - 1


# ---- numpy engine against the reference -------------------------------------------------------------------------

@pytest.mark.parametrize("start", ["token", "prefill"])
@pytest.mark.parametrize("horizon", [2, 4])
def test_the_numpy_engine_equals_the_reference_for_action_chunks(horizon, start):
    cfg = cfg_for(horizon, start)
    w = random_weights(cfg, seed=3)
    eng = NumpyEngine(cfg, w, kv_for(cfg), instruction=INSTRUCTION)
    stream = R.start_stream(cfg, w, kv_for(cfg), INSTRUCTION)
    off, first, steps = cfg.action_token_offset, 0 if start == "prefill" else 1, eng.decode_steps
    evicted, steps_differ = 0, False
    for fid, tok in enumerate(frames(5, cfg.hidden_size, seed=4)):  # 5 frames, budget 3: FIFO evicts twice
        res, ref = eng.run_chunk(tok, fid), R.reference_chunk(stream, tok, fid)
        assert res.evicted_frames == ref.evicted
        evicted += len(ref.evicted)
        assert ref.logits.shape == eng.last_logits.shape == (steps + 1, cfg.n_action_bins)
        scale = 1.0 + np.abs(ref.logits).max()
        err = np.abs(eng.last_logits - ref.logits).max() / scale
        assert err < 2e-5, f"H={horizon} {start} frame {fid}: logits differ from the reference by {err:.2e}"
        assert np.array_equal(res.token_ids, ref.token_ids), f"H={horizon} {start} frame {fid}"
        # time-major: row k = gen[first + k * dims .. first + (k + 1) * dims - 1] - offset
        for k in range(horizon):
            row = res.token_ids[first + k * DIMS:first + (k + 1) * DIMS] - off
            assert np.array_equal(res.chunk_bins[k], row) and np.array_equal(ref.chunk_bins[k], row)
            np.testing.assert_array_equal(res.chunk[k], eng.tokenizer.bins_to_action(res.chunk_bins[k]))
        assert res.chunk.shape == ref.chunk.shape == (horizon, DIMS) and res.chunk.dtype == np.float32
        assert res.chunk_bins.dtype == np.int64
        np.testing.assert_array_equal(res.chunk, ref.chunk)
        np.testing.assert_array_equal(res.chunk[0], res.action)
        np.testing.assert_array_equal(res.chunk_bins[0], res.action_bins)
        assert res.horizon == horizon
        steps_differ |= not np.array_equal(res.chunk_bins[0], res.chunk_bins[-1])
    assert evicted == 2
    assert steps_differ, "every chunk's steps are equal: this test could not tell the rows apart"


def test_h1_results_keep_their_shape_and_a_bare_result_gets_one_row_of_bins():
    cfg = cfg_for(1, "token")
    eng = NumpyEngine(cfg, random_weights(cfg), kv_for(cfg), instruction=INSTRUCTION, decode_tokens=12)
    r = eng.run_chunk(frames(1, cfg.hidden_size, seed=5)[0], 0)
    assert r.token_ids.shape == (13,) and r.chunk.shape == (1, DIMS)
    assert np.array_equal(r.action_bins, r.token_ids[1:1 + DIMS] - cfg.action_token_offset)
    assert np.array_equal(r.chunk_bins, r.action_bins[None])
    bare = ChunkResult(1, np.zeros(9, np.int64), np.arange(7, dtype=np.int64), np.zeros(7, np.float32), 1.0, 1.0, 2.0)
    assert bare.chunk_bins.shape == (1, 7) and np.array_equal(bare.chunk_bins[0], np.arange(7))


# ---- positions, refusals ---------------------------------------------------------------------------------------

def test_the_position_check_counts_the_effective_decode_steps():
    budget = 224  # 7 prefix tokens + 6 frames of 32 (a multiple of tokens_per_frame)
    d = cfg_dict(4, "token", max_pos=budget + 20)  # budget + 8 fits, budget + 29 does not
    h1 = cfg_for(1, "token", max_pos=budget + 20)
    geometry.check_positions(h1, budget, 8)
    NumpyEngine(h1, random_weights(h1), kv_for(h1, budget=budget), instruction=INSTRUCTION).close()
    cfg = ModelConfig.from_json(d)
    with pytest.raises(EngineError, match=r"kv_budget_tokens=224 \+ 29 decode steps .* must stay below "
                                          r"max_position_embeddings=244"):
        NumpyEngine(cfg, random_weights(cfg), kv_for(cfg, budget=budget), instruction=INSTRUCTION)
    prefill = cfg_for(4, "prefill", max_pos=budget + 20)
    with pytest.raises(EngineError, match=r"kv_budget_tokens=224 \+ 27 decode steps"):
        geometry.check_positions(prefill, budget, 8)


class _NumpyConfigOnly(NumpyEngine):
    def __init__(self, cfg):  # only what chunk_support_problem reads
        self.cfg = cfg


class _CudaConfigOnly(CudaEngine):
    def __init__(self, cfg):
        self.cfg = cfg


@pytest.mark.parametrize("backend", [_NumpyConfigOnly, _CudaConfigOnly])
def test_both_backends_accept_chunks_and_only_cuda_refuses_parallel_past_eight_row_tiles_by_name(backend):
    assert backend(cfg_for(4, "token")).chunk_support_problem() is None
    assert backend(cfg_for(1, "token")).chunk_support_problem() is None
    assert backend(cfg_for(4, "token", chunk_decode="parallel")).chunk_support_problem() is None  # 28 slots
    assert backend(cfg_for(8, "token", chunk_decode="parallel")).chunk_support_problem() is None  # 56: two tiles
    problem = backend(cfg_for(37, "token", chunk_decode="parallel")).chunk_support_problem()  # 259 slots
    if backend is _NumpyConfigOnly:
        assert problem is None  # issue 22: numpy decodes parallel chunks of any width
    else:
        assert problem and "vla.chunk_decode='parallel' with 259 action slots" in problem and backend.name in problem
    assert unsupported_reason(cfg_for(4, "token")) is None  # the CUDA backend builds H > 1 "token" chunks


# ---- the factory and the inference loop -------------------------------------------------------------------------

class _Recording:
    """Passes everything to the engine and keeps its results (what the loop's warm-up measured)."""

    def __init__(self, engine):
        self.engine, self.results = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def run_chunk(self, *args):
        self.results.append(self.engine.run_chunk(*args))
        return self.results[-1]


def test_make_engine_runs_an_h4_checkpoint_and_the_loop_counts_its_decode_steps(tmp_path):
    cfg = cfg_for(4, "token")
    ckpt = write_checkpoint(tmp_path / "h4", cfg_dict(4, "token"), random_weights(cfg, seed=7))
    logs = []
    eng = make_engine({"backend": "numpy", "checkpoint": str(ckpt), "kv_budget_tokens": 256,
                       "instruction": INSTRUCTION}, log=logs.append)
    try:
        assert eng.decode_steps == 29 and eng.decode_tokens == 8 and eng.chunk_support_problem() is None
        assert any("1 prefill + 29 decode steps" in m for m in logs), logs
        wrapped = FaultInjectingEngine(eng, "raise@1000", log=logs.append)
        assert wrapped.decode_steps == 29 and wrapped.chunk_support_problem() is None
        rec = _Recording(eng)
        loop = InferenceLoop(rec, DoubleBuffer(), AdmissionController(33.0, 2.0, 0.2), 33.0,
                             on_action=lambda *_: None, decode_tokens=eng.decode_steps, action_horizon=4)
        figures = loop.warmup(1)
        (r,) = rec.results
        assert r.chunk.shape == (4, DIMS) and r.token_ids.shape == (30,)
        assert figures["decode_ms_per_token"] == pytest.approx(r.decode_ms / 29, rel=1e-9)
    finally:
        eng.close()


def test_make_engine_refuses_a_budget_whose_decode_steps_reach_max_positions(tmp_path):
    cfg = cfg_for(4, "token", max_pos=256 + 20)
    ckpt = write_checkpoint(tmp_path / "h4", cfg_dict(4, "token", max_pos=256 + 20), random_weights(cfg))
    with pytest.raises(EngineError, match=r"kv_budget_tokens=256 \+ 29 decode steps .*max_position_embeddings=276"):
        make_engine({"backend": "numpy", "checkpoint": str(ckpt), "kv_budget_tokens": 256,
                     "instruction": INSTRUCTION}, log=lambda *_: None)


# ---- the CUDA backend (GPU: skipped here, run on the device) ---------------------------------------------------

@pytest.mark.gpu
def test_the_cuda_engine_decodes_an_h4_chunk_like_the_numpy_engine(torch_cuda, tmp_path):
    """Tiny geometry, H = 4: 29 decode steps in the graph, every step's logits against the numpy engine (bf16 vs
    float32: cosine, and the same greedy chain until a near-tie of the reference), FIFO eviction over 6 frames."""
    from test_cuda_model import INSTRUCTION as CUDA_INSTRUCTION, cosine, make_engine as cuda_engine, random_checkpoint
    from vla_edge_ros.engine.checkpoint import load_checkpoint

    d = tiny_default_dict()
    d["vla"]["action_horizon"] = 4
    random_checkpoint(torch_cuda, d, tmp_path / "h4", seed=3)
    P = len(CUDA_INSTRUCTION.encode())
    budget = -(-(P + 3 * TPF) // TPF) * TPF
    cfg, kv, eng = cuda_engine(d, tmp_path / "h4", budget)
    ref = NumpyEngine(cfg, load_checkpoint(tmp_path / "h4", cfg), KVManager(budget, TPF, P, policy="fifo",
                      embed_dim=cfg.hidden_size), instruction=CUDA_INSTRUCTION, decode_tokens=8)
    try:
        assert eng.decode_steps == ref.decode_steps == 29
        rng = np.random.default_rng(0)
        for f in range(6):
            x = (0.05 * rng.standard_normal((TPF, cfg.hidden_size))).astype(np.float32)
            got, want = eng.run_chunk(x, f), ref.run_chunk(x, f)
            assert got.evicted_frames == want.evicted_frames
            assert eng.last_logits.shape == (30, cfg.n_action_bins) and got.token_ids.shape == (30,)
            assert got.chunk.shape == got.chunk_bins.shape == (4, DIMS)
            np.testing.assert_array_equal(got.chunk_bins, (got.token_ids[1:29] - cfg.action_token_offset).reshape(4, 7))
            np.testing.assert_array_equal(got.chunk[0], got.action)
            for i in range(30):
                c = cosine(eng.last_logits[i], ref.last_logits[i])
                assert c >= 0.999, (f, i, c)
                if got.token_ids[i] != want.token_ids[i]:  # a near-tie: the chains may part from here on
                    top2 = np.sort(ref.last_logits[i])[-2:]
                    assert top2[1] - top2[0] < 1e-2 * np.std(ref.last_logits[i]), (f, i)
                    break
    finally:
        eng.close()
