"""The chunk shape (issue 23 §1, ``vla.action_start``): "token" (the seed shape: the prefill gives an action-start
token, then decode_tokens steps) and "prefill" (the prefill's last logits give bin 1, then action_dims - 1 steps:
7 passes for 7 bins). The numpy backend, which decodes with exact speculative drafts, must equal the plain
reference forward (engine/reference.py) for both; the CUDA backend runs both (its GPU test: test_cuda_quant.py).
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from test_numpy_engine import random_weights  # the same non-degenerate weights (tied head: no lm_head row)
from vla_edge_ros.core.kv.manager import KVManager
from vla_edge_ros.engine import reference as R
from vla_edge_ros.engine.checkpoint import expected_shapes
from vla_edge_ros.engine.config import ACTION_STARTS, ModelConfig, ModelConfigError, tiny_default_dict
from vla_edge_ros.engine.cuda.engine import unsupported_reason
from vla_edge_ros.engine.factory import make_engine
from vla_edge_ros.engine.numpy_backend import NumpyEngine
from vla_edge_ros.engine.tiny_default import ensure_tiny_default

INSTRUCTION = "pick up"  # 7 byte tokens
TPF = 32
DECODE_TOKENS = 8
ABSENT = object()  # cfg_for(): leave vla.action_start out


def cfg_for(action_start=ABSENT):
    d = tiny_default_dict()
    d.update(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, max_position_embeddings=1024, rope_theta=10000.0)
    if action_start is not ABSENT:
        d["vla"]["action_start"] = action_start
    return ModelConfig.from_json(d)


def kv_for(cfg, frames=4):
    P = len(INSTRUCTION.encode())
    return KVManager(-(-(P + frames * TPF) // TPF) * TPF, TPF, P, policy="fifo", embed_dim=cfg.hidden_size)


def frames(n, hidden, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((TPF, hidden)).astype(np.float32) for _ in range(n)]


def engine(cfg, w, speculative):
    e = NumpyEngine(cfg, w, kv_for(cfg), instruction=INSTRUCTION, decode_tokens=DECODE_TOKENS)
    e.speculative = speculative
    return e


def steps_of(cfg):
    return cfg.action_dims - 1 if cfg.action_start == "prefill" else DECODE_TOKENS


# ---- the key ------------------------------------------------------------------------------------------------------

def test_action_start_defaults_to_the_seed_shape_and_round_trips():
    assert ACTION_STARTS == ("token", "prefill")
    assert cfg_for().action_start == "token" and "action_start" not in tiny_default_dict()["vla"]
    cfg = cfg_for("prefill")
    back = cfg.to_dict()
    assert back["vla"]["action_start"] == "prefill" and ModelConfig.from_json(back) == cfg
    assert cfg != cfg_for("token")


@pytest.mark.parametrize("value", ["bin", "PREFILL", None, 1, ["prefill"]])
def test_a_bad_action_start_is_refused_naming_the_key(value):
    with pytest.raises(ModelConfigError, match=r"vla\.action_start=.* is not one of token, prefill"):
        cfg_for(value)


# ---- engine against the reference ---------------------------------------------------------------------------------

@pytest.mark.parametrize("speculative", [True, False])
@pytest.mark.parametrize("action_start", ACTION_STARTS)
def test_the_numpy_engine_equals_the_reference_in_both_shapes(action_start, speculative):
    cfg = cfg_for(action_start)
    w = random_weights(cfg, seed=3)
    eng = engine(cfg, w, speculative)
    stream = R.start_stream(cfg, w, kv_for(cfg), INSTRUCTION, decode_tokens=DECODE_TOKENS)
    steps, off, dims = steps_of(cfg), cfg.action_token_offset, cfg.action_dims
    first = 0 if action_start == "prefill" else 1
    for fid, tok in enumerate(frames(7, cfg.hidden_size, seed=4)):  # 7 > 4 frames of budget: FIFO evicts
        res = eng.run_chunk(tok, fid)
        ref = R.reference_chunk(stream, tok, fid)
        assert res.evicted_frames == ref.evicted
        assert ref.logits.shape == eng.last_logits.shape == (steps + 1, cfg.n_action_bins)
        assert res.token_ids.shape == ref.token_ids.shape == (steps + 1,)
        scale = 1.0 + np.abs(ref.logits).max()
        err = np.abs(eng.last_logits - ref.logits).max() / scale
        assert err < 2e-5, f"{action_start} frame {fid}: logits differ from the reference by {err:.2e}"
        # within that error the greedy choice can only differ where the top two are closer than twice it
        srt = np.sort(ref.logits, axis=1)
        clear = srt[:, -1] - srt[:, -2] > 4e-5 * scale
        assert clear.sum() > len(clear) // 2, "mostly near ties: pick another seed"
        assert np.array_equal(res.token_ids[clear], ref.token_ids[clear]), f"{action_start} frame {fid}"
        # the layout: which greedy choices are the bins; the prefill's own choice is bin 1 in the new shape
        assert np.array_equal(res.action_bins, res.token_ids[first:first + dims] - off)
        assert ref.action_bins[0] == np.argmax(ref.logits[first])
        np.testing.assert_allclose(res.action, eng.tokenizer.bins_to_action(res.action_bins))
        if speculative:
            assert 1 <= eng.last_decode_passes <= steps
        else:
            assert eng.last_decode_passes == steps  # prefill shape: action_dims - 1 = 6 decode passes
        assert eng.last_max_position == eng.kv.occupancy_tokens + steps - 1


def test_the_prefill_shape_is_the_seed_chain_without_its_start_and_end_tokens():
    """Same weights and frames: the greedy chain is the same, only where the bins are read and how far it runs."""
    seed_cfg, new_cfg = cfg_for("token"), cfg_for("prefill")
    w = random_weights(seed_cfg, seed=5)
    old, new = engine(seed_cfg, w, speculative=False), engine(new_cfg, w, speculative=False)
    dims, off = new_cfg.action_dims, new_cfg.action_token_offset
    varied = False
    for fid, tok in enumerate(frames(5, seed_cfg.hidden_size, seed=6)):
        a, b = old.run_chunk(tok, fid), new.run_chunk(tok, fid)
        assert np.array_equal(b.token_ids, a.token_ids[:dims])  # one-token passes: the same computation
        assert np.array_equal(new.last_logits, old.last_logits[:dims])
        assert np.array_equal(b.action_bins, a.token_ids[:dims] - off)
        assert np.array_equal(a.action_bins, a.token_ids[1:dims + 1] - off)  # today's layout, unchanged
        assert (old.last_decode_passes, new.last_decode_passes) == (DECODE_TOKENS, dims - 1)
        varied |= not np.array_equal(a.action_bins, b.action_bins)
    assert varied, "the two shapes read the same bins on every frame: this test could not tell them apart"


# ---- the CUDA backend and the factory -----------------------------------------------------------------------------

def test_the_cuda_backend_takes_both_shapes():
    # the 7-pass shape on the GPU: test/test_cuda_quant.py::test_the_7_pass_shape_matches_the_numpy_engine_in_bf16
    assert unsupported_reason(cfg_for("token")) is None and unsupported_reason(cfg_for()) is None
    assert unsupported_reason(cfg_for("prefill")) is None


def test_make_engine_runs_a_checkpoint_of_the_new_shape(tmp_path):
    ckpt = tmp_path / "prefill"
    shutil.copytree(ensure_tiny_default(tmp_path / "cache"), ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["vla"]["action_start"] = "prefill"
    (ckpt / "config.json").write_text(json.dumps(config))
    logs = []
    eng = make_engine({"backend": "numpy", "checkpoint": str(ckpt), "kv_budget_tokens": 256}, log=logs.append)
    dims = eng.cfg.action_dims
    assert eng.chunk_support_problem() is None and eng.decode_steps == dims - 1
    assert any(f"1 prefill + {dims - 1} decode steps" in m for m in logs), logs
    eng.speculative = False
    r = eng.run_chunk(eng.encode_frame(np.zeros((64, 128, 3), np.uint8)), 0)
    assert r.token_ids.shape == (dims,) and np.array_equal(r.action_bins, r.token_ids - eng.cfg.action_token_offset)
    assert eng.last_decode_passes == dims - 1
