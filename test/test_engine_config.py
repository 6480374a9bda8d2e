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
    assert geometry == (256, 2, 4, 2)  # 2 layers: the CPU default (config.tiny_default_dict says why)
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
    assert ensure_tiny_default() == tmp_path / "cache" / "tiny-default-v2"


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
    assert (tmp_path / "tiny-default-v2" / "model.safetensors").is_file()
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


# ---- HF keys that change the math: RoPE base, RoPE type, sliding window, layout ----------------------------

def hf5(**changes):
    """The tiny config as transformers 5.x writes it: the RoPE base only inside rope_parameters."""
    d = tiny_default_dict()
    theta = d.pop("rope_theta")
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    d.update(changes)
    return d


def test_rope_theta_is_read_from_both_spellings(tmp_path):
    from vla_edge_ros.engine.config import HF_DEFAULT_ROPE_THETA
    top = tiny_default_dict()
    top.update(rope_theta=12345.0, rope_scaling=None)  # 4.x: top level, rope_scaling null
    assert ModelConfig.from_json(top).rope_theta == 12345.0
    assert ModelConfig.from_json(hf5(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
                                 ).rope_theta == 10000.0
    assert ModelConfig.from_json(hf5(rope_parameters={"rope_theta": 5e5})).rope_theta == 5e5  # type defaults
    # rope_scaling is the same dict under its 4.x name (5.x keeps it as an alias)
    legacy = hf5(rope_parameters=None, rope_scaling={"type": "default", "rope_theta": 2e4})
    assert ModelConfig.from_json(legacy).rope_theta == 2e4
    # 5.x nesting per layer type
    nested = hf5(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 3e4}})
    assert ModelConfig.from_json(nested).rope_theta == 3e4
    # both spellings, same value: fine
    agree = hf5(rope_theta=1e6)
    assert ModelConfig.from_json(agree).rope_theta == 1e6 != HF_DEFAULT_ROPE_THETA
    # from a file too, and what to_dict writes back (top level) reads back equal
    (tmp_path / "config.json").write_text(json.dumps(hf5(rope_parameters={"rope_type": "default",
                                                                          "rope_theta": 10000.0})))
    cfg = ModelConfig.from_json(tmp_path)
    assert cfg.rope_theta == 10000.0 and ModelConfig.from_json(cfg.to_dict()) == cfg


def test_rope_theta_absent_everywhere_is_hf_default():
    d = tiny_default_dict()
    del d["rope_theta"]
    assert ModelConfig.from_json(d).rope_theta == 10000.0  # HF default_theta / Qwen2Config, not 1e6
    for empty in (None, {}, {"rope_type": "default"}):
        assert ModelConfig.from_json({**d, "rope_parameters": empty, "rope_scaling": empty}).rope_theta == 10000.0


@pytest.mark.parametrize("config, names", [
    (hf5(rope_theta=1e6, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
     ("rope_theta=1000000.0", "rope_parameters.rope_theta=10000.0")),
    (hf5(rope_scaling={"rope_type": "default", "rope_theta": 5e5}),
     ("rope_parameters.rope_theta=1000000.0", "rope_scaling.rope_theta=500000.0")),
    (hf5(rope_parameters={"full_attention": {"rope_theta": 1e4}, "sliding_attention": {"rope_theta": 1e6}}),
     ("rope_parameters.full_attention.rope_theta=10000.0", "rope_parameters.sliding_attention.rope_theta")),
])
def test_disagreeing_rope_bases_are_refused_naming_each(config, names):
    with pytest.raises(EngineError, match="RoPE base is given more than once with different values") as err:
        ModelConfig.from_json(config)
    assert all(n in str(err.value) for n in names)


@pytest.mark.parametrize("kind", ["linear", "dynamic", "yarn", "longrope", "llama3", "su", "mrope", "ntk"])
@pytest.mark.parametrize("key, type_key", [("rope_scaling", "type"), ("rope_scaling", "rope_type"),
                                           ("rope_parameters", "rope_type")])
def test_unimplemented_rope_types_are_refused_by_name(kind, key, type_key):
    from vla_edge_ros.engine.config import ModelConfigError
    d = tiny_default_dict()
    d[key] = {type_key: kind, "factor": 4.0, "original_max_position_embeddings": 4096}
    with pytest.raises(ModelConfigError, match=f"{key} type '{kind}' is not implemented by vla_edge_ros "
                                               r"\(only default RoPE\)") as err:
        ModelConfig.from_json(d)
    assert isinstance(err.value, ValueError) and isinstance(err.value, EngineError)  # either catch works


@pytest.mark.parametrize("change, message", [
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}},
     "mrope_section: multimodal RoPE"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "factor": 2.0}},
     "key.s. factor that default RoPE does not use"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}},
     "rope_parameters.partial_rotary_factor=0.5 is not implemented"),
    ({"partial_rotary_factor": 0.25}, "partial_rotary_factor=0.25 is not implemented"),
    ({"rope_parameters": {"rope_type": "default", "type": "linear"}}, "they disagree"),
    ({"rope_parameters": {"rope_type": 3}}, "rope_parameters.rope_type must be a string"),
    ({"rope_parameters": "default"}, "rope_parameters must be an object or null"),
    ({"rope_parameters": {"rope_theta": None}}, "rope_parameters.rope_theta must be a positive finite"),
    ({"rope_theta": None}, "rope_theta must be a positive finite number, got None"),
])
def test_rope_keys_that_would_change_the_math_are_refused(change, message):
    d = tiny_default_dict()
    del d["rope_theta"]  # so only the key under test gives a RoPE base
    d.update(change)
    with pytest.raises(EngineError, match=message):
        ModelConfig.from_json(d)


def test_plain_rope_spellings_are_accepted():
    for extra in ({"rope_scaling": None}, {"rope_scaling": {}}, {"rope_scaling": {"type": "default"}},
                  {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 1.0}},
                  {"partial_rotary_factor": 1.0}, {"partial_rotary_factor": None}):
        assert ModelConfig.from_json({**tiny_default_dict(), **extra}).rope_theta == 1e6


def test_sliding_window_only_where_it_cannot_bind():
    d = {**tiny_default_dict(), "num_hidden_layers": 4}  # 4 layers, max_position_embeddings 8192
    ok = [{"use_sliding_window": False, "sliding_window": 16, "max_window_layers": 0},  # off
          {"use_sliding_window": True, "sliding_window": 16},  # HF's max_window_layers 28 >= 4 layers: none slide
          {"use_sliding_window": True, "sliding_window": 8192, "max_window_layers": 0},  # window >= every context
          {"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0},
          {"use_sliding_window": True, "sliding_window": 16, "layer_types": ["full_attention"] * 4}]
    for extra in ok:
        assert ModelConfig.from_json({**d, **extra}).num_hidden_layers == 4
    with pytest.raises(EngineError, match="layers 2..3 would attend only to the last 4096 tokens"):
        ModelConfig.from_json({**d, "use_sliding_window": True, "max_window_layers": 2})  # HF default window 4096
    with pytest.raises(EngineError, match=r"layers 1..3 .* last 8191 tokens .* max_position_embeddings=8192"):
        ModelConfig.from_json({**d, "use_sliding_window": True, "sliding_window": 8191,
                               "layer_types": ["full_attention"] + ["sliding_attention"] * 3})
    with pytest.raises(EngineError, match="layer_types 'chunked_attention' not implemented"):
        ModelConfig.from_json({**d, "layer_types": ["full_attention"] * 3 + ["chunked_attention"]})
    with pytest.raises(EngineError, match="layer_types must be a list of 4 entries"):
        ModelConfig.from_json({**d, "layer_types": ["full_attention"] * 3})
    with pytest.raises(EngineError, match="use_sliding_window must be true or false"):
        ModelConfig.from_json({**d, "use_sliding_window": "no"})


def test_absent_keys_take_hf_defaults():
    d = tiny_default_dict()
    del d["tie_word_embeddings"]
    cfg = ModelConfig.from_json(d)
    assert cfg.tie_word_embeddings is False  # HF Qwen2Config default: a separate lm_head.weight
    from vla_edge_ros.engine.checkpoint import expected_shapes
    assert "lm_head.weight" in expected_shapes(cfg)  # so a checkpoint without one is refused at load
    d = tiny_default_dict()
    del d["num_key_value_heads"]
    with pytest.raises(EngineError, match="num_key_value_heads is absent, so HF Qwen2Config's default 32"):
        ModelConfig.from_json(d)  # 4 heads: 32 KV heads cannot be meant
    d.update(hidden_size=512, num_attention_heads=32)
    assert ModelConfig.from_json(d).num_key_value_heads == 32
    d["num_key_value_heads"] = None  # HF: null means one KV head per query head
    d["num_attention_heads"] = 8
    assert ModelConfig.from_json(d).num_key_value_heads == 8


@pytest.mark.parametrize("change, message", [
    ({"model_type": "qwen3"}, "model_type='qwen3' is not implemented"),
    ({"model_type": "llama"}, "model_type='llama'"),
    ({"attention_bias": False}, "attention_bias=False"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, r"quantization_config \('awq'\)"),
    ({"head_dim": 128}, "head_dim=128 differs"),
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act='gelu_pytorch_tanh' is not implemented"),
])
def test_layouts_the_kernels_do_not_implement_are_refused_by_name(change, message):
    with pytest.raises(EngineError, match=message):
        ModelConfig.from_json({**tiny_default_dict(), **change})


def test_equivalent_layout_spellings_are_accepted():
    base = ModelConfig.from_json(tiny_default_dict())
    for extra in ({"model_type": "qwen2"}, {"attention_bias": True}, {"head_dim": 64}, {"head_dim": None},
                  {"hidden_act": "swish"}, {"quantization_config": None}):
        assert ModelConfig.from_json({**tiny_default_dict(), **extra}) == base


def _small_engine(cfg_dict, tmp_path, name):
    """A checkpoint written to disk with ``cfg_dict`` and read back the normal way (config.json -> engine)."""
    from vla_edge_ros.core.kv.manager import KVManager
    from vla_edge_ros.engine.checkpoint import expected_shapes, load_checkpoint, write_checkpoint
    from vla_edge_ros.engine.numpy_backend import NumpyEngine
    shape_cfg = ModelConfig.from_json({**cfg_dict, "rope_theta": 1.0, "rope_parameters": None})
    rng = np.random.default_rng(3)
    tensors = {n: (rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32)
               for n, s in expected_shapes(shape_cfg, include_vision=True).items()}
    for n in tensors:
        if n.endswith("norm.weight"):
            tensors[n] = np.ones_like(tensors[n])
        elif n.endswith(("q_proj.weight", "k_proj.weight")):
            tensors[n] *= 4.0  # sharp attention, so where a key sits (its rotation) shows in the logits
    ckpt = write_checkpoint(tmp_path / name, cfg_dict, tensors, dtype="float32")
    cfg = ModelConfig.from_json(ckpt)
    kv = KVManager(7 + 4 * 32 + 25, 32, 7, policy="fifo", embed_dim=cfg.hidden_size)
    return NumpyEngine(cfg, load_checkpoint(ckpt, cfg), kv, instruction="pick up", decode_tokens=8)


def test_parsed_rope_base_reaches_the_engine(tmp_path):
    from vla_edge_ros.engine.rope import rope_tables
    small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, max_position_embeddings=1024)
    hf4_1e4 = {**tiny_default_dict(), **small, "rope_theta": 1e4}
    hf5_1e4 = hf5(**small, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    hf4_1e6 = {**tiny_default_dict(), **small, "rope_theta": 1e6}
    engines = {n: _small_engine(c, tmp_path, n) for n, c in (("a", hf4_1e4), ("b", hf5_1e4), ("c", hf4_1e6))}
    pos = np.arange(1024)
    cos4, sin4 = rope_tables(pos, 16, 1e4)
    cos6, _ = rope_tables(pos, 16, 1e6)
    assert np.array_equal(engines["b"].rope.cos, cos4) and not np.allclose(engines["b"].rope.cos, cos6, atol=1e-3)
    assert np.array_equal(engines["b"].rope.sin_signed[:, 8:], sin4[:, 8:])
    frames = np.random.default_rng(5).standard_normal((3, 32, 64)).astype(np.float32)
    logits = {}
    for n, eng in engines.items():
        for fid, f in enumerate(frames):
            eng.run_chunk(f, fid)
        logits[n] = eng.last_logits.copy()
    assert np.array_equal(logits["a"], logits["b"])  # the 5.x spelling computes what the 4.x one does
    assert np.abs(logits["b"] - logits["c"]).max() > 0.1  # and the base is not 1e6 in disguise
