"""ModelConfig parsing / validation, the tiny default checkpoint, and make_engine's backend choice."""
from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest

from vla_edge_ros.engine.config import (ModelConfig, qwen2_5_0_5b_dict, qwen2_5_1_5b_dict, tiny_default_dict)
from vla_edge_ros.engine.interface import ChunkResult, EngineError


def test_real_geometries():
    big = ModelConfig.from_json(qwen2_5_1_5b_dict())
    geometry = (big.hidden_size, big.num_hidden_layers, big.num_attention_heads, big.num_key_value_heads)
    assert geometry == (1536, 28, 12, 2)
    assert (big.head_dim, big.n_groups, big.intermediate_size, big.vocab_size) == (128, 6, 8960, 151936)
    assert big.tie_word_embeddings and big.rope_theta == 1e6 and big.max_position_embeddings == 32768
    small = ModelConfig.from_json(qwen2_5_0_5b_dict())
    assert (small.hidden_size, small.num_hidden_layers, small.num_attention_heads, small.head_dim) == (896, 24, 14, 64)
    assert small.intermediate_size == 4864 and small.num_key_value_heads == 2
    tiny = ModelConfig.from_json(tiny_default_dict())
    geometry = (tiny.hidden_size, tiny.num_hidden_layers, tiny.num_attention_heads, tiny.num_key_value_heads)
    assert geometry == (256, 4, 4, 2)
    assert (tiny.intermediate_size, tiny.vocab_size, tiny.max_position_embeddings) == (704, 512, 8192)
    assert tiny.n_patches == 32 and tiny.patch_dim == 768 and tiny.image_hw == (64, 128)
    assert tiny.action_token_offset == 256


def test_vla_block_defaults_and_round_trip(tmp_path):
    d = qwen2_5_0_5b_dict()
    d.pop("vla", None)
    cfg = ModelConfig.from_json(d)
    assert cfg.action_dims == 7 and cfg.n_action_bins == 256 and cfg.patch_grid == (4, 8) and cfg.patch_size == 16
    assert cfg.action_names[-1] == "gripper" and len(cfg.action_q01) == 7
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_dict()))
    again = ModelConfig.from_json(path)
    assert again == cfg and again.source == str(path)
    assert ModelConfig.from_json(tmp_path) == cfg  # a checkpoint directory works too


@pytest.mark.parametrize("change, message", [
    ({"num_attention_heads": 5}, "does not divide hidden_size"),
    ({"num_key_value_heads": 3}, "does not divide num_attention_heads"),
    ({"vocab_size": 400}, "vocab_size=400 is too small"),
    ({"hidden_size": "256"}, "hidden_size must be an integer"),
    ({"num_hidden_layers": 0}, "num_hidden_layers=0 must be >= 1"),
    ({"rope_theta": -1}, "rope_theta must be a positive"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"type": "yarn"}}, "rope_scaling"),
    ({"head_dim": 32}, "head_dim"),
    ({"vla": {"action_dims": 3}}, "action_q01"),
    ({"vla": {"action_q01": [0.0] * 6}}, "action_q01 must be a list of 7"),
    ({"vla": {"action_q01": [1.0] * 7, "action_q99": [0.0] * 7}}, "q01 must be <="),
    ({"vla": {"patch_grid": [4]}}, "patch_grid"),
    ({"vla": "nope"}, "'vla' must be an object"),
])
def test_invalid_configs_are_refused_with_the_reason(change, message):
    d = tiny_default_dict()
    d.update(change)
    with pytest.raises(EngineError, match=message):
        ModelConfig.from_json(d)


def test_missing_keys_and_bad_files(tmp_path):
    d = tiny_default_dict()
    del d["vocab_size"]
    with pytest.raises(EngineError, match="missing required key.*vocab_size"):
        ModelConfig.from_json(d)
    bad = tmp_path / "config.json"
    bad.write_text('{"hidden_size": 256,,}')
    with pytest.raises(EngineError, match=r"config\.json: invalid JSON .*line 1"):
        ModelConfig.from_json(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(EngineError, match="must be a JSON object"):
        ModelConfig.from_json(bad)
    with pytest.raises(EngineError, match="file not found"):
        ModelConfig.from_json(tmp_path / "nothing" / "config.json")


# ---- tiny default ------------------------------------------------------------------------------------------

def test_tiny_default_is_deterministic_atomic_and_repaired(tmp_path):
    from vla_edge_ros.engine.checkpoint import load_checkpoint
    from vla_edge_ros.engine.tiny_default import NAME, ensure_tiny_default
    a = ensure_tiny_default(tmp_path / "a")
    b = ensure_tiny_default(tmp_path / "b")
    assert a.name == NAME and (a / "config.json").is_file() and (a / "model.safetensors").is_file()
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert not [p for p in (tmp_path / "a").iterdir() if p.name != NAME]  # no temporary leftovers
    cfg = ModelConfig.from_json(a)
    w = load_checkpoint(a, cfg)
    assert "vision.patch_embed.weight" in w and w["model.embed_tokens.weight"].shape == (512, 256)
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_default(tmp_path / "a") == a and (a / "model.safetensors").stat().st_mtime_ns == mtime
    # a damaged cache (truncated weights) is detected by the manifest and regenerated
    data = (a / "model.safetensors").read_bytes()
    (a / "model.safetensors").write_bytes(data[:1000])
    again = ensure_tiny_default(tmp_path / "a")
    assert (again / "model.safetensors").read_bytes() == data


def test_tiny_default_uses_env_cache(tmp_path, monkeypatch):
    from vla_edge_ros.engine.tiny_default import ensure_tiny_default
    monkeypatch.setenv("VLA_EDGE_ROS_CACHE", str(tmp_path / "cache"))
    assert ensure_tiny_default() == tmp_path / "cache" / "tiny-default-v1"


# ---- factory -----------------------------------------------------------------------------------------------

@pytest.fixture
def no_cuda_module(monkeypatch):
    """Make `vla_edge_ros.engine.cuda_backend` report no GPU, whatever this machine has."""
    mod = types.ModuleType("vla_edge_ros.engine.cuda_backend")
    mod.cuda_available = lambda: False
    mod.cuda_unavailable_reason = lambda: "no GPU in this test"
    monkeypatch.setitem(sys.modules, "vla_edge_ros.engine.cuda_backend", mod)
    import vla_edge_ros.engine as pkg
    monkeypatch.setattr(pkg, "cuda_backend", mod, raising=False)
    return mod


def test_make_engine_default_runs_the_tiny_model(tmp_path, monkeypatch, no_cuda_module):
    from vla_edge_ros.engine.factory import make_engine
    monkeypatch.setenv("VLA_EDGE_ROS_CACHE", str(tmp_path))
    logs = []
    eng = make_engine({"backend": "auto", "kv_budget_tokens": 256, "eviction_policy": "fifo"}, log=logs.append)
    assert eng.name == "numpy" and any("backend=numpy" in m and "no GPU in this test" in m for m in logs)
    assert (tmp_path / "tiny-default-v1" / "model.safetensors").is_file()
    assert eng.kv.prefix_tokens == len("pick up the object") and eng.kv.budget_tokens == 256
    img = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    res = None
    for fid in range(10):
        res = eng.run_chunk(eng.encode_frame(img), fid)
    assert isinstance(res, ChunkResult) and res.token_ids.shape == (9,) and res.action.shape == (7,)
    assert np.all(res.token_ids >= 256) and np.all(res.action_bins < 256)
    cfg = eng.cfg
    assert np.all(res.action >= np.array(cfg.action_q01) - 1e-6)
    assert np.all(res.action <= np.array(cfg.action_q99) + 1e-6)
    assert res.kv_occupancy_tokens <= 256 and res.evicted_frames  # 10 frames do not fit: evictions happened
    assert res.total_ms >= res.prefill_ms + res.decode_ms > 0


def test_make_engine_refuses_bad_parameters(tmp_path, monkeypatch, no_cuda_module):
    from vla_edge_ros.engine.factory import make_engine
    monkeypatch.setenv("VLA_EDGE_ROS_CACHE", str(tmp_path))
    quiet = lambda m: None  # noqa: E731
    with pytest.raises(EngineError, match="cuda.*no GPU in this test"):
        make_engine({"backend": "cuda"}, log=quiet)
    with pytest.raises(EngineError, match="not a multiple of tokens_per_frame"):
        make_engine({"backend": "numpy", "kv_budget_tokens": 1000}, log=quiet)
    with pytest.raises(EngineError, match="eviction_policy"):
        make_engine({"backend": "numpy", "eviction_policy": "lru"}, log=quiet)
    with pytest.raises(EngineError, match="tokens_per_frame=16 must equal"):
        make_engine({"backend": "numpy", "tokens_per_frame": 16, "kv_budget_tokens": 1024}, log=quiet)
    with pytest.raises(EngineError, match="max_position_embeddings=8192"):
        make_engine({"backend": "numpy", "kv_budget_tokens": 8192}, log=quiet)
    with pytest.raises(EngineError, match="decode_tokens=4"):
        make_engine({"backend": "numpy", "decode_tokens": 4}, log=quiet)
    with pytest.raises(EngineError, match="smaller than the pinned prefix"):
        make_engine({"backend": "numpy", "kv_budget_tokens": 32}, log=quiet)
    with pytest.raises(EngineError, match="no such directory"):
        make_engine({"backend": "numpy", "checkpoint": str(tmp_path / "missing")}, log=quiet)


def test_auto_without_cuda_module_falls_back(tmp_path, monkeypatch):
    import vla_edge_ros.engine.factory as factory
    monkeypatch.setenv("VLA_EDGE_ROS_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "vla_edge_ros.engine.cuda_backend", None)  # import raises ImportError
    mod, why = factory._cuda_probe()
    assert mod is None and "not importable" in why
    logs = []
    eng = factory.make_engine({"kv_budget_tokens": 128}, log=logs.append)
    assert eng.name == "numpy" and "not importable" in logs[0]
