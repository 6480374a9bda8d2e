"""The CUDA engine's parallel decode and forced prefix (issue 22) against the numpy engine, their oracle.

Parallel (``vla.chunk_decode: parallel``): after the frame's prefill, one prefill-shaped pass over the A = H x 7
action slots (bidirectional among them: cuda/rope_attention.cu meta[4]), gen[1 + r] = slot r's argmax; more than
32 slots run in 32-row tiles (forward._layers), more than pass_meta.PARALLEL_MAX_TILES tiles are refused by name, before
anything is allocated. Forced prefix
(``run_chunk(forced_bins=(d, 7))``): the forced ids go to the device with the meta copy and every argmax writes them
where given, so the decode chain is teacher-forced and the parallel choices replaced, as numpy does.

CPU: the refusals and the checks that run before the device is touched. GPU (marked ``gpu``): CudaEngine vs
NumpyEngine on the tiny geometry with random weights and FIFO eviction, bf16 against float32: every row's logits at
cosine >= 0.999 (the tolerance of test_cuda_model.py) and equal tokens, except at a near-tie of the reference
(after which an autoregressive chain may legitimately part; parallel rows are independent, so only that row).
"""
from __future__ import annotations

import numpy as np
import pytest

from test_chunk_horizon import cfg_for
from vla_edge_ros.core.kv.manager import KVManager
from vla_edge_ros.engine.config import tiny_default_dict
from vla_edge_ros.engine.cuda.engine import CudaEngine, unsupported_reason
from vla_edge_ros.engine.interface import EngineError

DIMS, TPF = 7, 32


class _CudaConfigOnly(CudaEngine):
    def __init__(self, cfg):  # only what the refusals and the host-side checks read
        self.cfg = cfg


# ---- CPU -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("horizon", [1, 4, 5, 8, 36])  # 7 .. 252 slots: 1 .. 8 row tiles
def test_cuda_accepts_parallel_chunks_of_up_to_eight_row_tiles(horizon):
    cfg = cfg_for(horizon, "token", chunk_decode="parallel")
    assert _CudaConfigOnly(cfg).chunk_support_problem() is None and unsupported_reason(cfg) is None


@pytest.mark.parametrize("horizon", [37, 50])  # 259, 350 slots
def test_cuda_refuses_a_parallel_chunk_wider_than_eight_tiles_by_name_before_allocating(horizon):
    cfg = cfg_for(horizon, "token", chunk_decode="parallel")
    problem = _CudaConfigOnly(cfg).chunk_support_problem()
    assert problem and "cuda" in problem and f"vla.chunk_decode='parallel' with {7 * horizon} action slots" in problem
    assert unsupported_reason(cfg) in problem
    kv = KVManager(128, TPF, 7, policy="fifo", embed_dim=cfg.hidden_size)
    with pytest.raises(EngineError, match=rf"refuses the model: vla.chunk_decode='parallel' with {7 * horizon} "):
        CudaEngine(cfg, {}, kv, instruction="pick up")  # refused before the GPU probe: runs on a CPU too
    assert _CudaConfigOnly(cfg_for(horizon, "token")).chunk_support_problem() is None  # autoregressive: any A


@pytest.mark.parametrize("forced, why", [
    (np.zeros((5, DIMS), np.int64), "more than the chunk's action_horizon 4"),
    (np.full((1, DIMS), 256), r"must lie in \[0, 256\)"),
    (np.zeros((1, 6), np.int64), r"shape \(d, action_dims=7\)")])
def test_bad_forced_bins_are_refused_with_the_reason_before_the_device(forced, why):
    eng = _CudaConfigOnly(cfg_for(4, "token"))
    with pytest.raises(ValueError, match=why):
        eng.run_chunk(np.zeros((TPF, 64), np.float32), 0, forced_bins=forced)


@pytest.mark.parametrize("d", [0, 1, 4])
def test_good_forced_bins_go_on_to_the_device(d):
    """Accepted (no EngineError any more): the call goes on to the device state this config-only engine lacks."""
    eng = _CudaConfigOnly(cfg_for(4, "token"))
    with pytest.raises(AttributeError):
        eng.run_chunk(np.zeros((TPF, 64), np.float32), 0, forced_bins=np.zeros((d, DIMS), np.int64))


# ---- GPU -------------------------------------------------------------------------------------------------------

def _pair(torch, tmp_path, horizon=4, decode="parallel", start="token", frames=3, seed=3, **kw):
    """(cfg, cuda engine, numpy engine) on the same random tiny checkpoint, FIFO budget of ``frames`` frames."""
    from test_cuda_model import INSTRUCTION, make_engine, random_checkpoint
    from vla_edge_ros.engine.checkpoint import load_checkpoint
    from vla_edge_ros.engine.numpy_backend import NumpyEngine
    d = tiny_default_dict()
    d["vla"].update(action_horizon=horizon, chunk_decode=decode, action_start=start)
    random_checkpoint(torch, d, tmp_path / "ckpt", seed=seed)
    P = len(INSTRUCTION.encode())
    budget = -(-(P + frames * TPF) // TPF) * TPF
    cfg, _, eng = make_engine(d, tmp_path / "ckpt", budget, **kw)
    ref = NumpyEngine(cfg, load_checkpoint(tmp_path / "ckpt", cfg),
                      KVManager(budget, TPF, P, policy="fifo", embed_dim=cfg.hidden_size), instruction=INSTRUCTION,
                      decode_tokens=8)
    return cfg, eng, ref


def _frames(n, hidden, seed=0):
    rng = np.random.default_rng(seed)
    return [(0.05 * rng.standard_normal((TPF, hidden))).astype(np.float32) for _ in range(n)]


def _near_tie(logits: np.ndarray) -> bool:
    top2 = np.sort(logits)[-2:]
    return bool(top2[1] - top2[0] < 1e-2 * np.std(logits))


def _compare(eng, ref, got, want, where, chained: bool) -> int:
    """Logits (cosine) and tokens of every gen entry; returns the near-ties met. chained: an autoregressive chain,
    not comparable after the first near-tie that parted it."""
    from test_cuda_model import cosine
    assert got.evicted_frames == want.evicted_frames, where
    assert eng.last_logits.shape == ref.last_logits.shape and got.token_ids.shape == want.token_ids.shape, where
    ties = 0
    for i in range(len(want.token_ids)):
        c = cosine(eng.last_logits[i], ref.last_logits[i])
        assert c >= 0.999, (where, i, c)
        if got.token_ids[i] != want.token_ids[i]:
            assert _near_tie(ref.last_logits[i]), (where, i, got.token_ids, want.token_ids)
            ties += 1
            if chained:
                break
    return ties


@pytest.mark.gpu
@pytest.mark.parametrize("use_graphs, pdl", [(True, True), (False, True), (True, False)])
def test_parallel_chunks_match_the_numpy_engine(torch_cuda, tmp_path, use_graphs, pdl):
    """H = 4, 28 slots, 6 frames over a budget of 3 (FIFO evicts 3 times); graphs on and off (the slot rows'
    copy captured or eager), PDL on and off."""
    cfg, eng, ref = _pair(torch_cuda, tmp_path, use_graphs=use_graphs, tuning={"pdl": pdl})
    try:
        assert (eng.decode_steps, eng.scratch_slots) == (ref.decode_steps, ref.scratch_slots) == (1, 28)
        evicted = ties = 0
        for f, x in enumerate(_frames(6, cfg.hidden_size)):
            got, want = eng.run_chunk(x, f), ref.run_chunk(x, f)
            ties += _compare(eng, ref, got, want, f"frame {f}", chained=False)
            evicted += len(want.evicted_frames)
            assert got.token_ids.shape == (29,) and got.chunk_bins.shape == got.chunk.shape == (4, DIMS)
            np.testing.assert_array_equal(got.chunk_bins.ravel(), got.token_ids[1:29] - cfg.action_token_offset)
            assert got.prefill_ms > 0 and (got.decode_ms > 0) != eng.fused and got.forced_steps == 0  # fused: 1 pass
        assert evicted == 3 and ties <= 6 * 29 // 20, (evicted, ties)  # near-ties flipped in at most 5 % of rows
    finally:
        eng.close()


@pytest.mark.gpu
@pytest.mark.parametrize("horizon, use_graphs, gemm, fused", [
    (8, True, "tiles32", False), (8, False, "tiles32", False), (10, True, "tiles32", False), (8, True, "tiled", False),
    (10, False, "tiled", False), (4, True, "tiles32", True), (4, True, "tiled", True), (8, True, "tiled", True),
    (8, False, "tiles32", True), (10, True, "tiled", True)])
def test_tiled_parallel_chunks_match_the_numpy_engine(torch_cuda, tmp_path, horizon, use_graphs, gemm, fused):
    """H = 8 (56 slots: two row tiles) and H = 10 (70: three, the last of 6 rows), with eviction, graphs on and off:
    the tiles' attention sees every slot's key (tile 0 stores them, later tiles stage them from the cache), so
    every slot's logits equal numpy's; the GEMMs per tile or over all tiles at once (tuning parallel_gemm); the
    frame's prefill apart or fused with the slots into one pass (tuning fused_parallel; H = 4 too: 2 tiles then)."""
    cfg, eng, ref = _pair(torch_cuda, tmp_path, horizon=horizon, use_graphs=use_graphs,
                          tuning={"parallel_gemm": gemm, "fused_parallel": fused})
    a = 7 * horizon
    try:
        assert bool(eng.plan.parallel_gemms) == (gemm == "tiled" and -(-a // 32) + fused > 1) and eng.fused == fused
        assert (eng.decode_steps, eng.scratch_slots, eng.act.tiles) == (1, a, -(-a // 32))
        evicted = ties = 0
        for f, x in enumerate(_frames(5, cfg.hidden_size, seed=horizon)):
            got, want = eng.run_chunk(x, f), ref.run_chunk(x, f)
            ties += _compare(eng, ref, got, want, f"frame {f}", chained=False)
            evicted += len(want.evicted_frames)
            assert got.token_ids.shape == (a + 1,) and got.chunk_bins.shape == (horizon, DIMS)
        assert evicted == 2 and ties <= 5 * (a + 1) // 20, (evicted, ties)
        # a forced prefix replaces the first steps' choices of the tiled pass too
        x = _frames(1, cfg.hidden_size, seed=99)[0]
        forced = np.arange(2 * DIMS, dtype=np.int64).reshape(2, DIMS)
        got, want = eng.run_chunk(x, 5, forced_bins=forced), ref.run_chunk(x, 5, forced_bins=forced)
        np.testing.assert_array_equal(got.chunk_bins[:2], forced)
        ties += _compare(eng, ref, got, want, "forced", chained=False)
    finally:
        eng.close()


@pytest.mark.gpu
@pytest.mark.parametrize("decode, start", [("autoregressive", "token"), ("autoregressive", "prefill"),
                                           ("parallel", "token")])
def test_a_forced_prefix_matches_the_numpy_engine(torch_cuda, tmp_path, decode, start):
    """d = 0 (forced_bins None, right after a forced chunk: the device's forced ids must be cleared), 1, .., 4 over
    10 frames with eviction: the forced bins verbatim, every other entry as numpy decodes it (autoregressive: fed
    the forced tokens; parallel: the slots' own choices)."""
    cfg, eng, ref = _pair(torch_cuda, tmp_path, decode=decode, start=start)
    rng = np.random.default_rng(11)
    first, off = (0 if start == "prefill" else 1), cfg.action_token_offset
    try:
        for f, x in enumerate(_frames(10, cfg.hidden_size, seed=1)):
            d = f % 5
            forced = rng.integers(0, cfg.n_action_bins, size=(d, DIMS)) if d else None
            got, want = eng.run_chunk(x, f, forced_bins=forced), ref.run_chunk(x, f, forced_bins=forced)
            assert got.forced_steps == want.forced_steps == d
            n = d * DIMS
            if d:
                np.testing.assert_array_equal(got.chunk_bins[:d], forced)
                np.testing.assert_array_equal(got.token_ids[first:first + n], forced.ravel() + off)
            _compare(eng, ref, got, want, f"{decode}/{start} frame {f} d={d}", chained=decode == "autoregressive")
            # every entry not forced is the argmax of its own row's logits (the forced rows keep the model's logits)
            free = np.setdiff1d(np.arange(len(got.token_ids)), np.arange(first, first + n))
            np.testing.assert_array_equal(got.token_ids[free], np.argmax(eng.last_logits[free], axis=1) + off)
    finally:
        eng.close()
