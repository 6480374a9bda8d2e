"""Safetensors loader: good single / sharded / bf16 checkpoints, and every bad case refused with its reason."""
from __future__ import annotations

import json
import pickle
import struct

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from vla_edge_ros.engine.checkpoint import (bf16_bits_to_f32, expected_shapes, f32_to_bf16_bits, load_checkpoint,
                                            write_checkpoint)
from vla_edge_ros.engine.config import ModelConfig, tiny_default_dict
from vla_edge_ros.engine.interface import EngineError


def small_dict(tied=True):
    d = tiny_default_dict()
    d.update(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=48, tie_word_embeddings=tied)
    return d


def tensors_for(cfg, seed=0, vision=True):
    rng = np.random.default_rng(seed)
    shapes = expected_shapes(cfg, include_vision=vision)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}


@pytest.fixture
def cfg():
    return ModelConfig.from_json(small_dict())


def test_expected_shapes(cfg):
    shapes = expected_shapes(cfg)
    assert shapes["model.embed_tokens.weight"] == (512, 32)
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (16, 32)  # 2 kv heads x head_dim 8
    assert shapes["model.layers.0.self_attn.q_proj.bias"] == (32,)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (32, 48)
    assert "lm_head.weight" not in shapes and len(shapes) == 1 + 2 * 12 + 1
    untied = ModelConfig.from_json(small_dict(tied=False))
    assert expected_shapes(untied)["lm_head.weight"] == (512, 32)
    assert expected_shapes(cfg, include_vision=True)["vision.pos_embed"] == (32, 32)


def test_float32_single_file_round_trip_and_compatibility(tmp_path, cfg):
    t = tensors_for(cfg)
    write_checkpoint(tmp_path, cfg.to_dict(), t, dtype="float32")
    assert ModelConfig.from_json(tmp_path) == cfg
    other = load_file(str(tmp_path / "model.safetensors"))  # the reference library reads what we write
    assert all(np.array_equal(other[n], t[n]) for n in t)
    got = load_checkpoint(tmp_path, cfg)
    assert set(got) == set(t) and all(np.array_equal(got[n], t[n]) and got[n].dtype == np.float32 for n in t)
    # and we read what the reference library writes (decoder only: vision tensors are optional)
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    dec = {n: v for n, v in t.items() if not n.startswith("vision.")}
    save_file(dec, str(ref_dir / "model.safetensors"))
    got = load_checkpoint(ref_dir, cfg)
    assert set(got) == set(dec) and all(np.array_equal(got[n], dec[n]) for n in dec)


def test_sharded_bf16(tmp_path, cfg):
    t = tensors_for(cfg, seed=1)
    write_checkpoint(tmp_path, cfg.to_dict(), t, dtype="bfloat16", shards=3)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    got = load_checkpoint(tmp_path, cfg)
    for n in t:
        want = bf16_bits_to_f32(f32_to_bf16_bits(t[n]))
        assert np.array_equal(got[n], want), n
        assert np.max(np.abs(got[n] - t[n]) / (np.abs(t[n]) + 1e-3)) < 1 / 128
    raw = load_checkpoint(tmp_path, cfg, dtype="bfloat16")
    assert raw["model.norm.weight"].dtype == np.uint16
    assert np.array_equal(bf16_bits_to_f32(raw["model.norm.weight"]), got["model.norm.weight"])
    half = load_checkpoint(tmp_path, cfg, dtype=np.float16)
    assert half["model.norm.weight"].dtype == np.float16


def test_bf16_conversion_rounds_to_nearest_even():
    x = np.array([1.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -2.5, np.inf, 0.0], np.float32)
    back = bf16_bits_to_f32(f32_to_bf16_bits(x))
    assert back.tolist() == [1.0, 1.0, 1.0 + 2 ** -6, -2.5, np.inf, 0.0]
    assert np.isnan(bf16_bits_to_f32(f32_to_bf16_bits(np.array([np.nan], np.float32))))[0]


def test_tied_checkpoint_may_carry_a_redundant_lm_head(tmp_path, cfg):
    t = tensors_for(cfg, vision=False)
    t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()
    write_checkpoint(tmp_path, cfg.to_dict(), t, dtype="float32")
    assert "lm_head.weight" not in load_checkpoint(tmp_path, cfg)


def _write(tmp_path, cfg, t, **kw):
    write_checkpoint(tmp_path, cfg.to_dict(), t, **kw)
    return tmp_path


def test_missing_tensor(tmp_path, cfg):
    t = tensors_for(cfg)
    del t["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(EngineError, match=r"missing tensor\(s\) model\.layers\.1\.mlp\.up_proj\.weight"):
        load_checkpoint(_write(tmp_path, cfg, t), cfg)


def test_extra_tensor_and_config_mismatch(tmp_path, cfg):
    t = tensors_for(cfg)
    t["model.layers.2.mlp.up_proj.weight"] = np.zeros((48, 32), np.float32)
    with pytest.raises(EngineError, match=r"unexpected tensor\(s\) model\.layers\.2\.mlp\.up_proj\.weight"):
        load_checkpoint(_write(tmp_path, cfg, t), cfg)


def test_wrong_shape_names_tensor_expected_and_found(tmp_path, cfg):
    t = tensors_for(cfg)
    t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((32, 32), np.float32)
    with pytest.raises(EngineError, match=r"tensor model\.layers\.0\.self_attn\.k_proj\.weight: expected shape "
                                          r"\[16, 32\], found \[32, 32\]"):
        load_checkpoint(_write(tmp_path, cfg, t), cfg)


def test_wrong_dtype(tmp_path, cfg):
    t = tensors_for(cfg, vision=False)
    t["model.norm.weight"] = np.arange(32, dtype=np.int32)
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(EngineError, match=r"tensor model\.norm\.weight: expected dtype F32, F16 or BF16, found I32"):
        load_checkpoint(tmp_path, cfg)


def test_incomplete_vision_tensors(tmp_path, cfg):
    t = tensors_for(cfg)
    del t["vision.pos_embed"]
    with pytest.raises(EngineError, match="vision tensors incomplete: missing vision.pos_embed"):
        load_checkpoint(_write(tmp_path, cfg, t), cfg)


def test_truncated_file(tmp_path, cfg):
    _write(tmp_path, cfg, tensors_for(cfg), dtype="float32")
    f = tmp_path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-100])
    with pytest.raises(EngineError, match=r"truncated file: tensor .* ends at byte \d+, the file has only"):
        load_checkpoint(tmp_path, cfg)
    f.write_bytes(data[:5])
    with pytest.raises(EngineError, match="truncated safetensors file"):
        load_checkpoint(tmp_path, cfg)
    f.write_bytes(struct.pack("<Q", 10 ** 6) + b"{}")
    with pytest.raises(EngineError, match="truncated or not a safetensors file"):
        load_checkpoint(tmp_path, cfg)


def test_corrupt_header(tmp_path, cfg):
    header = b'{"model.norm.weight": {"dtype": "F32", "shape": [32], "data_offsets": [0, 99]}}'
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(128))
    with pytest.raises(EngineError, match=r"model\.norm\.weight: data_offsets \[0, 99\] do not match shape"):
        load_checkpoint(tmp_path, cfg)
    bad = b"{not json"
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(bad)) + bad)
    with pytest.raises(EngineError, match="corrupt safetensors header"):
        load_checkpoint(tmp_path, cfg)


def test_bad_json_in_config_and_index(tmp_path, cfg):
    _write(tmp_path, cfg, tensors_for(cfg), shards=2)
    (tmp_path / "config.json").write_text('{"hidden_size": 32,')
    with pytest.raises(EngineError, match=r"config\.json: invalid JSON"):
        ModelConfig.from_json(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{oops")
    with pytest.raises(EngineError, match=r"model\.safetensors\.index\.json: invalid JSON"):
        load_checkpoint(tmp_path, cfg)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"model.norm.weight": "gone.safetensors"}}')
    with pytest.raises(EngineError, match="shard gone.safetensors is listed but missing"):
        load_checkpoint(tmp_path, cfg)


def test_pickle_checkpoints_are_refused_never_unpickled(tmp_path, cfg):
    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('unpickled!')",))

    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    (tmp_path / "pytorch_model.bin").write_bytes(pickle.dumps(Boom()))
    with pytest.raises(EngineError, match=r"pytorch_model\.bin: pickle-based checkpoint refused"):
        load_checkpoint(tmp_path, cfg)
    with pytest.raises(EngineError, match="pickle-based checkpoint refused"):
        load_checkpoint(tmp_path / "pytorch_model.bin", cfg)
    (tmp_path / "model.pt").write_bytes(b"PK")
    with pytest.raises(EngineError, match="refused"):
        load_checkpoint(tmp_path / "model.pt", cfg)


def test_empty_directory(tmp_path, cfg):
    with pytest.raises(EngineError, match=r"no \*\.safetensors file found"):
        load_checkpoint(tmp_path, cfg)
    with pytest.raises(EngineError, match="no such directory"):
        load_checkpoint(tmp_path / "nope", cfg)
