"""action_readout (engine/geometry.readout_actions): a chunk's slots become actions as the argmax bin's centre or
as the mean of the bin centres under the slot's softmax. The decoded tokens and bins never change with it."""
from __future__ import annotations

import numpy as np
import pytest

from test_chunk_horizon import DIMS, INSTRUCTION, cfg_dict, cfg_for, frames, kv_for
from test_numpy_engine import random_weights
from vla_edge_ros import params
from vla_edge_ros.core.action_tokenizer import from_config as tokenizer_for
from vla_edge_ros.core.kv.manager import KVManager
from vla_edge_ros.engine import geometry
from vla_edge_ros.engine.checkpoint import write_checkpoint
from vla_edge_ros.engine.factory import make_engine
from vla_edge_ros.engine.fleet_numpy import FleetNumpyEngine
from vla_edge_ros.engine.interface import EngineError
from vla_edge_ros.engine.numpy_backend import NumpyEngine


def _expected_by_hand(cfg, logits):
    """The expectation readout written out without the tokenizer: bin b's centre is -1 + (b + 0.5) * 2 / n."""
    n = cfg.n_action_bins
    first = 0 if cfg.action_start == "prefill" else 1
    a = cfg.action_horizon * cfg.action_dims
    z = np.asarray(logits, np.float64)[first:first + a]
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    centres = -1.0 + (np.arange(n) + 0.5) * 2.0 / n
    x = (p @ centres).reshape(cfg.action_horizon, cfg.action_dims)
    q01, q99 = np.asarray(cfg.action_q01), np.asarray(cfg.action_q99)
    return 0.5 * (x + 1.0) * (q99 - q01) + q01


def test_the_registry_and_the_engines_offer_the_same_readouts():
    assert params.ACTION_READOUTS == geometry.ACTION_READOUTS
    assert params.BY_NAME["action_readout"].default == "argmax"
    assert params.BY_NAME["action_readout"].validate("mode") is not None


def test_a_peaked_slot_reads_out_its_bin_and_two_equal_modes_read_out_their_mean():
    cfg = cfg_for(2, "token")
    tok = tokenizer_for(cfg)
    a = 2 * DIMS
    rng = np.random.default_rng(0)
    bins = rng.integers(0, cfg.n_action_bins, size=(2, DIMS))
    logits = np.full((a + 2, cfg.n_action_bins), -50.0, np.float32)
    logits[1:a + 1][np.arange(a), bins.reshape(-1)] = 50.0  # one bin holds all the mass
    got = geometry.readout_actions(cfg, tok, bins, logits, "expectation")
    np.testing.assert_allclose(got, geometry.chunk_actions(tok, bins), atol=1e-6)
    # slot 0 split evenly between bins 10 and 30: the mean of their centres, which neither bin is
    logits[1, :] = -50.0
    logits[1, [10, 30]] = 5.0
    got = geometry.readout_actions(cfg, tok, bins, logits, "expectation")
    mid = tok.unnormalize(np.r_[tok.bin_centers[20], tok.bin_centers[bins[0, 1:]]])
    assert got[0, 0] == pytest.approx(mid[0], abs=1e-6)
    assert got[0, 0] != pytest.approx(geometry.chunk_actions(tok, bins)[0, 0])
    # a forced prefix keeps the forced bins' actions: they were given, not decoded
    forced = geometry.readout_actions(cfg, tok, bins, logits, "expectation", forced_steps=1)
    np.testing.assert_array_equal(forced[0], geometry.chunk_actions(tok, bins)[0])
    np.testing.assert_array_equal(forced[1], got[1])
    # argmax ignores the logits
    np.testing.assert_array_equal(geometry.readout_actions(cfg, tok, bins, logits, "argmax"),
                                  geometry.chunk_actions(tok, bins))


def test_a_bad_readout_or_logits_of_the_wrong_shape_are_refused_by_name():
    cfg = cfg_for(1, "token")
    tok = tokenizer_for(cfg)
    bins = np.zeros((1, DIMS), np.int64)
    with pytest.raises(EngineError, match="action_readout must be one of argmax, expectation, got 'mean'"):
        geometry.readout_actions(cfg, tok, bins, np.zeros((9, cfg.n_action_bins)), "mean")
    with pytest.raises(EngineError, match=r"expectation readout: .* shape \(3, 256\)"):
        geometry.readout_actions(cfg, tok, bins, np.zeros((4, cfg.n_action_bins)), "expectation")
    with pytest.raises(EngineError, match="action_readout"):
        NumpyEngine(cfg, random_weights(cfg), kv_for(cfg), instruction=INSTRUCTION, action_readout="mean")


@pytest.mark.parametrize("horizon, start, vla", [(1, "token", {}), (1, "prefill", {}), (4, "token", {}),
                                                 (4, "token", {"chunk_decode": "parallel"})])
def test_the_numpy_engine_reads_out_the_expectation_of_its_own_logits(horizon, start, vla):
    cfg = cfg_for(horizon, start, **vla)
    w = random_weights(cfg, seed=3)
    argmax = NumpyEngine(cfg, w, kv_for(cfg), instruction=INSTRUCTION)
    mean = NumpyEngine(cfg, w, kv_for(cfg), instruction=INSTRUCTION, action_readout="expectation")
    differs = 0
    for f, x in enumerate(frames(4, cfg.hidden_size, seed=1)):
        a, e = argmax.run_chunk(x, f), mean.run_chunk(x, f)
        np.testing.assert_array_equal(e.token_ids, a.token_ids)  # the decode is the argmax's either way
        np.testing.assert_array_equal(e.chunk_bins, a.chunk_bins)
        np.testing.assert_array_equal(a.chunk, geometry.chunk_actions(argmax.tokenizer, a.chunk_bins))
        assert e.chunk.shape == (horizon, DIMS) and e.chunk.dtype == np.float32
        np.testing.assert_allclose(e.chunk, _expected_by_hand(cfg, mean.last_logits), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(e.action, e.chunk[0])
        differs += int(not np.allclose(e.chunk, a.chunk, atol=1e-4))
    assert differs > 0  # random weights spread their mass: the two readouts are not the same numbers


def test_a_forced_prefix_keeps_its_bins_under_the_expectation_readout():
    cfg = cfg_for(4, "token", chunk_decode="parallel")
    eng = NumpyEngine(cfg, random_weights(cfg, seed=5), kv_for(cfg), instruction=INSTRUCTION,
                      action_readout="expectation")
    forced = np.array([[3, 4, 5, 6, 7, 8, 9], [200, 201, 202, 203, 204, 205, 206]])
    r = eng.run_chunk(frames(1, cfg.hidden_size, seed=2)[0], 0, forced_bins=forced)
    assert r.forced_steps == 2
    np.testing.assert_array_equal(r.chunk[:2], geometry.chunk_actions(eng.tokenizer, forced))
    np.testing.assert_allclose(r.chunk[2:], _expected_by_hand(cfg, eng.last_logits)[2:], rtol=1e-5, atol=1e-6)


def test_the_fleet_reads_out_each_robot_as_its_engine_alone_does():
    cfg = cfg_for(4, "token", chunk_decode="parallel")
    w = random_weights(cfg, seed=4)
    fleet = FleetNumpyEngine(cfg, w, lambda: kv_for(cfg), instruction=INSTRUCTION, action_readout="expectation")
    alone = {n: NumpyEngine(cfg, w, kv_for(cfg), instruction=INSTRUCTION, action_readout="expectation")
             for n in ("a", "b")}
    for n in alone:
        fleet.add_robot(n)
    xs = frames(2, cfg.hidden_size, seed=9)

    class Req:
        def __init__(self, x, f):
            self.vision_tokens, self.frame_id, self.salient = x, f, False

    out = fleet.run_batch({"a": Req(xs[0], 0), "b": Req(xs[1], 0)})
    for n, x in zip(("a", "b"), xs):
        want = alone[n].run_chunk(x, 0)
        np.testing.assert_array_equal(out[n].chunk_bins, want.chunk_bins)
        np.testing.assert_allclose(out[n].chunk, want.chunk, rtol=1e-4, atol=1e-5)
        assert not np.allclose(out[n].chunk, geometry.chunk_actions(alone[n].tokenizer, want.chunk_bins), atol=1e-4)


def test_make_engine_passes_the_readout_and_refuses_a_bad_one(tmp_path):
    cfg = cfg_for(4, "token", chunk_decode="parallel")
    ckpt = write_checkpoint(tmp_path / "p4", cfg_dict(4, "token", chunk_decode="parallel"), random_weights(cfg))
    base = {"backend": "numpy", "checkpoint": str(ckpt), "kv_budget_tokens": 256, "instruction": INSTRUCTION}
    eng = make_engine({**base, "action_readout": "expectation"}, log=lambda *_: None)
    try:
        assert eng.action_readout == "expectation"
        r = eng.run_chunk(frames(1, cfg.hidden_size, seed=0)[0], 0)
        np.testing.assert_allclose(r.chunk, _expected_by_hand(cfg, eng.last_logits), rtol=1e-5, atol=1e-6)
    finally:
        eng.close()
    assert make_engine(base, log=lambda *_: None).action_readout == "argmax"
    with pytest.raises(EngineError, match="action_readout"):
        make_engine({**base, "action_readout": "median"}, log=lambda *_: None)


@pytest.mark.gpu
def test_the_cuda_engine_reads_out_the_expectation_of_its_own_logits_like_numpy(torch_cuda, tmp_path):
    """Parallel H = 4 on the tiny geometry: the CUDA engine's expectation readout is its own logits' (host-side,
    exact) and close to the numpy engine's (bf16 against float32 logits)."""
    from test_cuda_model import INSTRUCTION as CUDA_INSTRUCTION, make_engine as cuda_engine, random_checkpoint
    from vla_edge_ros.engine.checkpoint import load_checkpoint
    from vla_edge_ros.engine.config import ModelConfig, tiny_default_dict

    d = tiny_default_dict()
    d["vla"].update(action_horizon=4, chunk_decode="parallel")
    random_checkpoint(torch_cuda, d, tmp_path / "p4", seed=3)
    P, tpf = len(CUDA_INSTRUCTION.encode()), ModelConfig.from_json(d).n_patches
    budget = -(-(P + 3 * tpf) // tpf) * tpf
    cfg, kv, eng = cuda_engine(d, tmp_path / "p4", budget, action_readout="expectation")
    ref = NumpyEngine(cfg, load_checkpoint(tmp_path / "p4", cfg),
                      KVManager(budget, cfg.n_patches, P, policy="fifo", embed_dim=cfg.hidden_size),
                      instruction=CUDA_INSTRUCTION, decode_tokens=8, action_readout="expectation")
    try:
        rng = np.random.default_rng(0)
        for f in range(4):
            x = (0.05 * rng.standard_normal((cfg.n_patches, cfg.hidden_size))).astype(np.float32)
            got, want = eng.run_chunk(x, f), ref.run_chunk(x, f)
            np.testing.assert_allclose(got.chunk, _expected_by_hand(cfg, eng.last_logits), rtol=1e-5, atol=1e-6)
            span = np.asarray(cfg.action_q99) - np.asarray(cfg.action_q01)
            assert np.all(np.abs(got.chunk - want.chunk) <= 0.01 * span + 1e-6), (f, got.chunk - want.chunk)
    finally:
        eng.close()


def test_the_fleet_edge_builds_its_engine_with_the_readout_and_refuses_a_bad_one(tmp_path):
    from vla_edge_ros.ros.fleet_node import build_fleet_engine

    cfg = cfg_for(4, "token", chunk_decode="parallel")
    ckpt = write_checkpoint(tmp_path / "p4", cfg_dict(4, "token", chunk_decode="parallel"), random_weights(cfg))
    base = {"backend": "numpy", "checkpoint": str(ckpt), "kv_budget_tokens": 256, "instruction": INSTRUCTION,
            "robot_namespaces": "r1,r2"}
    eng = build_fleet_engine({**base, "action_readout": "expectation"}, log=lambda m: None)
    eng.add_robot("r1")
    assert eng.action_readout == "expectation" and eng.robot("r1").action_readout == "expectation"
    assert build_fleet_engine(base, log=lambda m: None).action_readout == "argmax"
    with pytest.raises(EngineError, match="action_readout"):
        build_fleet_engine({**base, "action_readout": "mode"}, log=lambda m: None)
