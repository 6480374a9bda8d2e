"""NumpyEngine against the package's plain float64 forward (engine/reference.py, HF Qwen2 semantics).

The reference has none of the engine's slots, masks, rotation offset or speculative decoding. Two ways to use it:
- ``full_forward``: a plain causal forward over a whole token sequence (no cache at all);
- ``reference_chunk`` on a stream: KV-cache semantics, each frame's per-layer pre-RoPE K/V computed once when it
  arrives (attending to what was retained then), every chunk attending to the prefix and the retained frames
  rotated at their *current* logical positions, retention decided by a twin KV manager.
- for a one-layer model the two coincide (layer-0 pre-RoPE K/V do not depend on context), so after many
  evictions the engine must equal a from-scratch recomputation over exactly the retained frames.
"""
from __future__ import annotations

import numpy as np
import pytest

from vla_edge_ros.core.kv.manager import KVManager
from vla_edge_ros.engine import reference as R
from vla_edge_ros.engine.checkpoint import expected_shapes
from vla_edge_ros.engine.config import ModelConfig, tiny_default_dict
from vla_edge_ros.engine.numpy_backend import NumpyEngine, prefix_token_ids

TPF = 32
INSTRUCTION = "pick up"  # 7 byte tokens


def small_cfg(layers=2, tied=True, max_pos=1024, hidden=64, heads=4, kv_heads=2, inter=128):
    d = tiny_default_dict()
    d.update(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
             intermediate_size=inter, vocab_size=512, max_position_embeddings=max_pos, rope_theta=10000.0,
             tie_word_embeddings=tied)
    return ModelConfig.from_json(d)


def random_weights(cfg, seed=0, scale=1.0):
    """Non-degenerate random weights (attention and MLP matter; tokens are not just copied through)."""
    rng = np.random.default_rng(seed)
    w = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("norm.weight"):
            w[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif name.endswith(".bias"):
            w[name] = (0.2 * rng.standard_normal(shape)).astype(np.float32)
        elif name == "model.embed_tokens.weight" or name == "lm_head.weight":
            w[name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)  # small: tokens are not just echoed
        else:
            w[name] = (scale * rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
    return w


def make_kv(cfg, budget_frames, policy):
    P = len(INSTRUCTION.encode())
    budget = ((P + budget_frames * TPF + TPF - 1) // TPF) * TPF  # a multiple of TPF holding budget_frames frames
    kv = KVManager(budget, TPF, P, policy=policy, embed_dim=cfg.hidden_size)
    assert kv.capacity_frames == budget_frames
    return kv


def make_engine(cfg, w, budget_frames=64, policy="fifo", decode_tokens=8, speculative=True):
    e = NumpyEngine(cfg, w, make_kv(cfg, budget_frames, policy), instruction=INSTRUCTION,
                    decode_tokens=decode_tokens)
    e.speculative = speculative
    return e


# ---------------------------------------------------------------------------------------------------------
# the oracle: the package's plain float64 forward (engine/reference.py)

def full_forward(cfg, ref_w, seq):
    """Plain causal forward (no cache) over seq (T, hidden) -> action-row logits (T, 256)."""
    return R.action_logits(cfg, ref_w, R.forward(cfg, ref_w, seq)[0])


def reference_stream(cfg, w, budget_frames, policy):
    """The reference's KV-cache semantics under its own KV manager, twin of make_engine's."""
    return R.start_stream(cfg, w, make_kv(cfg, budget_frames, policy), INSTRUCTION, decode_tokens=8)


def check_chunk(engine, ref_logits, result, tag="", tol=2e-5):
    got = engine.last_logits.astype(np.float64)
    scale = 1.0 + np.abs(ref_logits).max()
    err = np.abs(got - ref_logits).max() / scale
    assert err < tol, f"{tag}: logits differ from the float64 reference by {err:.2e} (relative)"
    # greedy choices agree wherever the reference is not a near tie
    srt = np.sort(ref_logits, axis=1)
    clear = (srt[:, -1] - srt[:, -2]) > 1e-3 * scale
    ref_tok = np.argmax(ref_logits, axis=1) + engine.cfg.action_token_offset
    assert np.array_equal(result.token_ids[clear], ref_tok[clear]), f"{tag}: greedy tokens differ"
    return err


def frame_stream(n, hidden, seed=1, static_runs=False):
    rng = np.random.default_rng(seed)
    if not static_runs:
        return [rng.standard_normal((TPF, hidden)).astype(np.float32) for _ in range(n)]
    # long static stretches with small noise and occasional scene changes: semantic evicts mid-stream frames
    out, base = [], rng.standard_normal((TPF, hidden))
    for i in range(n):
        if rng.random() < 0.2:
            base = rng.standard_normal((TPF, hidden))
        out.append((base + 0.3 * rng.standard_normal((TPF, hidden))).astype(np.float32))
    return out


# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [True, False])
def test_full_model_matches_float64_forward_without_eviction(tied):
    cfg = small_cfg(layers=3, tied=tied)
    w = random_weights(cfg, seed=3)
    eng = make_engine(cfg, w, budget_frames=8)
    ref = R.load_weights(cfg, w)
    prefix = R.embed(ref, prefix_token_ids(INSTRUCTION))
    frames = frame_stream(5, cfg.hidden_size, seed=4)
    for fid, tok in enumerate(frames):
        res = eng.run_chunk(tok, fid)
        assert res.evicted_frames == []
        seq = np.concatenate([prefix] + [np.asarray(f, np.float64) for f in frames[:fid + 1]]
                             + [R.embed(ref, res.token_ids[:-1])])
        n_ctx = len(prefix) + (fid + 1) * TPF
        ref_logits = full_forward(cfg, ref, seq)[n_ctx - 1:]
        assert ref_logits.shape == (eng.decode_tokens + 1, 256)
        check_chunk(eng, ref_logits, res, f"frame {fid}")
        assert res.token_ids.shape == (9,) and res.action_bins.shape == (7,) and res.action.dtype == np.float32
        # layout of engine/interface.py: gen[0] action-start, gen[1..7] the bins, gen[8] the end token
        assert np.array_equal(res.action_bins, res.token_ids[1:8] - cfg.action_token_offset)
        np.testing.assert_allclose(res.action, eng.tokenizer.bins_to_action(res.action_bins))


@pytest.mark.parametrize("policy", ["fifo", "semantic"])
def test_after_many_evictions_equals_from_scratch_recompute(policy):
    """One-layer model: a fresh float64 forward over prefix + exactly the retained frames + new frame."""
    cfg = small_cfg(layers=1)
    w = random_weights(cfg, seed=5)
    eng = make_engine(cfg, w, budget_frames=6, policy=policy)
    ref = R.load_weights(cfg, w)
    prefix = R.embed(ref, prefix_token_ids(INSTRUCTION))
    frames = frame_stream(40, cfg.hidden_size, seed=6, static_runs=(policy == "semantic"))
    evicted_not_oldest = 0
    rerotated = 0
    deltas = set()
    for fid, tok in enumerate(frames):
        before = eng.kv.frames
        res = eng.run_chunk(tok, fid)
        evicted_not_oldest += sum(1 for f in res.evicted_frames if before and f != before[0])
        rerotated += eng.rerotated_slots
        deltas.add(eng.delta)
        retained = eng.kv.frames
        assert retained[-1] == fid and len(retained) <= 6
        assert eng.kv.occupancy_tokens <= eng.kv.budget_tokens
        seq = np.concatenate([prefix] + [np.asarray(frames[f], np.float64) for f in retained]
                             + [R.embed(ref, res.token_ids[:-1])])
        n_ctx = len(prefix) + len(retained) * TPF
        check_chunk(eng, full_forward(cfg, ref, seq)[n_ctx - 1:], res, f"{policy} frame {fid}")
    if policy == "fifo":
        assert eng.kv.frames == list(range(34, 40))
        assert len(deltas) > 1  # the shared rotation offset was used instead of re-rotating every frame
    else:
        assert evicted_not_oldest > 0, "the stream never made semantic eviction pick a middle frame"
        assert rerotated > 0


@pytest.mark.parametrize("policy", ["fifo", "semantic"])
def test_multilayer_stream_matches_kv_cache_reference(policy):
    cfg = small_cfg(layers=2)
    w = random_weights(cfg, seed=7)
    eng = make_engine(cfg, w, budget_frames=6, policy=policy)
    ref = reference_stream(cfg, w, budget_frames=6, policy=policy)
    frames = frame_stream(30, cfg.hidden_size, seed=8, static_runs=(policy == "semantic"))
    for fid, tok in enumerate(frames):
        res, want = eng.run_chunk(tok, fid), R.reference_chunk(ref, tok, fid)
        assert res.evicted_frames == want.evicted and eng.kv.frames == ref.kv.frames
        check_chunk(eng, want.logits, res, f"{policy} frame {fid}")
        assert np.array_equal(res.token_ids, want.token_ids), f"{policy} frame {fid}"
    if policy == "fifo":
        assert eng.kv.frames == list(range(24, 30))


def test_positions_stay_below_max_position_embeddings_in_a_long_stream():
    cfg = small_cfg(layers=1, max_pos=512)  # budget + decode = 7 + 4*32 (+25 unused) + 8 < 512
    w = random_weights(cfg, seed=9)
    eng = make_engine(cfg, w, budget_frames=4, policy="fifo")
    ref = R.load_weights(cfg, w)
    prefix = R.embed(ref, prefix_token_ids(INSTRUCTION))
    rng = np.random.default_rng(10)
    saw_reset = False
    prev_delta = 0
    for fid in range(400):
        tok = rng.standard_normal((TPF, cfg.hidden_size)).astype(np.float32)
        res = eng.run_chunk(tok, fid)
        assert eng.last_max_position < cfg.max_position_embeddings
        assert eng.last_max_rotation_position < cfg.max_position_embeddings
        saw_reset |= eng.delta < prev_delta
        prev_delta = eng.delta
        if fid % 50 == 49:  # still exact after the offset wrapped around
            retained = eng.kv.frames
            toks = {fid: tok}
            assert retained[-1] == fid
            # regenerate the retained frames' tokens from the same stream
            rng2 = np.random.default_rng(10)
            allt = [rng2.standard_normal((TPF, cfg.hidden_size)).astype(np.float32) for _ in range(fid + 1)]
            toks.update({f: allt[f] for f in retained})
            seq = np.concatenate([prefix] + [np.asarray(toks[f], np.float64) for f in retained]
                                 + [R.embed(ref, res.token_ids[:-1])])
            n_ctx = len(prefix) + len(retained) * TPF
            check_chunk(eng, full_forward(cfg, ref, seq)[n_ctx - 1:], res, f"frame {fid}")
    assert saw_reset, "the rotation offset never wrapped: the test did not reach the bound"


def test_speculative_decoding_equals_plain_greedy_and_rejects_drafts():
    cfg = small_cfg(layers=2)
    w = random_weights(cfg, seed=11)
    a = make_engine(cfg, w, budget_frames=4, speculative=True)
    b = make_engine(cfg, w, budget_frames=4, speculative=False)
    passes = []
    for fid, tok in enumerate(frame_stream(10, cfg.hidden_size, seed=12)):
        ra, rb = a.run_chunk(tok, fid), b.run_chunk(tok, fid)
        passes.append(a.last_decode_passes)
        assert b.last_decode_passes == b.decode_tokens
        assert np.array_equal(ra.token_ids, rb.token_ids)
        np.testing.assert_allclose(a.last_logits, b.last_logits, rtol=1e-4, atol=1e-4)
    assert max(passes) > 1, "no draft was ever rejected: the rejection path was not exercised"


def test_budget_shrink_relocates_frames_and_growth_reallocates():
    cfg = small_cfg(layers=1)
    w = random_weights(cfg, seed=13)
    eng = make_engine(cfg, w, budget_frames=8, policy="semantic")
    ref = R.load_weights(cfg, w)
    prefix = R.embed(ref, prefix_token_ids(INSTRUCTION))
    frames = frame_stream(20, cfg.hidden_size, seed=14, static_runs=True)

    def check(fid, res):
        retained = eng.kv.frames
        seq = np.concatenate([prefix] + [np.asarray(frames[f], np.float64) for f in retained]
                             + [R.embed(ref, res.token_ids[:-1])])
        check_chunk(eng, full_forward(cfg, ref, seq)[len(prefix) + len(retained) * TPF - 1:], res, f"frame {fid}")

    for fid in range(8):
        eng.run_chunk(frames[fid], fid)
    P = len(INSTRUCTION)
    eng.kv.set_budget(((P + 3 * TPF + TPF - 1) // TPF) * TPF)  # shrink: evicts and relocates frames
    check(8, eng.run_chunk(frames[8], 8))
    big = ((P + 12 * TPF + TPF - 1) // TPF) * TPF  # grow beyond the allocated capacity
    eng.kv.set_budget(big)
    for fid in range(9, 20):
        check(fid, eng.run_chunk(frames[fid], fid))
    assert eng.capacity >= big and len(eng.kv.frames) > 8


def test_reset_and_bad_input():
    cfg = small_cfg(layers=2)
    w = random_weights(cfg, seed=15)
    eng = make_engine(cfg, w, budget_frames=4)
    fresh = make_engine(cfg, w, budget_frames=4)
    frames = frame_stream(6, cfg.hidden_size, seed=16)
    for fid in range(5):
        eng.run_chunk(frames[fid], fid)
    occupancy = eng.kv.occupancy_tokens
    with pytest.raises(ValueError, match="shape"):
        eng.run_chunk(frames[5][:10], 99)
    bad = frames[5].copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        eng.run_chunk(bad, 99)
    assert eng.kv.occupancy_tokens == occupancy and 99 not in eng.kv.frames  # nothing admitted
    eng.reset()
    assert eng.kv.frames == []
    r1, r2 = eng.run_chunk(frames[5], 5), fresh.run_chunk(frames[5], 5)
    assert np.array_equal(r1.token_ids, r2.token_ids)
    np.testing.assert_allclose(eng.last_logits, fresh.last_logits, rtol=1e-5, atol=1e-5)
    mem = eng.memory()
    assert mem["current_bytes"] > eng.k_pre.nbytes and mem["peak_bytes"] >= mem["current_bytes"]
    eng.close()
    assert eng.memory()["current_bytes"] < mem["current_bytes"] - eng.k_pre.nbytes
    from vla_edge_ros.engine.interface import EngineError
    with pytest.raises(EngineError, match="closed"):
        eng.run_chunk(frames[0], 100)


def test_geometry_mismatches_are_refused():
    from vla_edge_ros.engine.interface import EngineError
    cfg = small_cfg(layers=1)
    w = random_weights(cfg, seed=17)
    P = len(INSTRUCTION)
    with pytest.raises(EngineError, match="tokens_per_frame"):
        NumpyEngine(cfg, w, KVManager(256, 16, P, embed_dim=64), instruction=INSTRUCTION)
    with pytest.raises(EngineError, match="prefix"):
        NumpyEngine(cfg, w, KVManager(256, 32, 3, embed_dim=64), instruction=INSTRUCTION)
    with pytest.raises(EngineError, match="decode_tokens"):
        NumpyEngine(cfg, w, KVManager(256, 32, P, embed_dim=64), instruction=INSTRUCTION, decode_tokens=3)
    broken = dict(w)
    broken["model.layers.0.mlp.up_proj.weight"] = np.zeros((5, 5), np.float32)
    with pytest.raises(EngineError, match="up_proj"):
        NumpyEngine(cfg, broken, KVManager(256, 32, P, embed_dim=64), instruction=INSTRUCTION)


def test_large_attention_scores_stay_exact():
    """Scores far beyond exp's float32 range take the max-subtracted softmax path (no inf / NaN)."""
    cfg = small_cfg(layers=2)
    w = random_weights(cfg, seed=19)
    for li in range(2):
        for n in ("q_proj", "k_proj"):
            w[f"model.layers.{li}.self_attn.{n}.weight"] *= 6.0
            w[f"model.layers.{li}.self_attn.{n}.bias"] *= 6.0
    eng = make_engine(cfg, w, budget_frames=3)
    ref = reference_stream(cfg, w, budget_frames=3, policy="fifo")
    for fid, tok in enumerate(frame_stream(6, cfg.hidden_size, seed=20)):
        res, want = eng.run_chunk(tok, fid), R.reference_chunk(ref, tok, fid)
        assert np.all(np.isfinite(eng.last_logits))
        check_chunk(eng, want.logits, res, f"frame {fid}", tol=3e-4)  # |scores| ~ 100: float32 rounding grows
        assert np.array_equal(res.token_ids, want.token_ids), f"frame {fid}"
    q = np.abs(eng.k_norm[:, :, :eng.kv.occupancy_tokens]).max()
    assert q > 20  # keys this long make |q|*|k| exceed the no-shift bound


@pytest.mark.slow
def test_one_hour_stream_at_10hz_keeps_positions_bounded_and_exact():
    """Issue 3: 36 000 frames (1 h at 10 Hz) through a bounded cache. Every position used for a query, a key
    rotation or a decode step stays below max_position_embeddings, and at checkpoints along the stream the
    output equals a from-scratch float64 recomputation over exactly the retained frames (one layer: see the
    module docstring). A micro geometry keeps it to ~1 ms per chunk."""
    cfg = small_cfg(layers=1, max_pos=512, hidden=32, heads=2, kv_heads=1, inter=64)
    w = random_weights(cfg, seed=11)
    eng = make_engine(cfg, w, budget_frames=4, policy="semantic")
    ref = R.load_weights(cfg, w)
    prefix = R.embed(ref, prefix_token_ids(INSTRUCTION))

    def frame(fid):  # regenerable: the checkpoints need the retained frames' tokens again
        rng = np.random.default_rng(fid)
        base = np.random.default_rng(fid // 50).standard_normal((TPF, cfg.hidden_size))  # static stretches
        return (base + 0.05 * rng.standard_normal((TPF, cfg.hidden_size))).astype(np.float32)

    n_frames, max_pos_seen, wraps, prev_delta = 36_000, 0, 0, 0
    for fid in range(n_frames):
        res = eng.run_chunk(frame(fid), fid)
        max_pos_seen = max(max_pos_seen, eng.last_max_position, eng.last_max_rotation_position)
        wraps += eng.delta < prev_delta
        prev_delta = eng.delta
        if fid % 6000 == 5999:
            retained = eng.kv.frames
            assert retained[-1] == fid and eng.kv.occupancy_tokens <= eng.kv.budget_tokens
            seq = np.concatenate([prefix] + [np.asarray(frame(f), np.float64) for f in retained]
                                 + [R.embed(ref, res.token_ids[:-1])])
            n_ctx = len(prefix) + len(retained) * TPF
            check_chunk(eng, full_forward(cfg, ref, seq)[n_ctx - 1:], res, f"frame {fid}")
    assert max_pos_seen < cfg.max_position_embeddings, max_pos_seen
    assert wraps > 0, "the rotation offset never wrapped: the stream did not reach the bound"
    assert eng.kv.stats()["evictions"] == n_frames - 4
