"""weight_dtype through the engines (issue 23): make_engine quantises at load or reads a pre-quantised checkpoint,
the numpy backend computes with exactly the oracle's arithmetic, the CUDA backend takes every type (its GPU tests:
test_cuda_quant.py), and the memory
checks count the quantised sizes with one shared function.

The oracle of a quantised engine is the same computation on engine/quant.py's dequantised weights: a bf16-path
NumpyEngine handed those weights (bit for bit: same float32 arrays, same arithmetic) and engine/reference.py's
float64 forward on them (to a tolerance, and equal greedy choices wherever the reference is not a near tie).
No GPU: the CUDA refusal is tested through the function that decides it and through CudaEngine's constructor,
which refuses before it touches CUDA.
"""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from vla_edge_ros import params
from vla_edge_ros.core.kv.manager import KVManager
from vla_edge_ros.engine import quant as Q
from vla_edge_ros.engine import quant_checkpoint as QC
from vla_edge_ros.engine import reference as R
from vla_edge_ros.engine.checkpoint import expected_shapes, load_checkpoint
from vla_edge_ros.engine.config import ModelConfig, tiny_default_dict
from vla_edge_ros.engine.cuda.engine import CudaEngine, defines_problem, unsupported_reason
from vla_edge_ros.engine.cuda.plan import padded_intermediate
from vla_edge_ros.engine.cuda.vram import memory_plan
from vla_edge_ros.engine.cuda.vram import GIB, check_budget, quantized_model_bytes
from vla_edge_ros.engine.factory import make_engine
from vla_edge_ros.engine.interface import EngineError
from vla_edge_ros.engine.numpy_backend import NumpyEngine, dequantized_weights
from vla_edge_ros.engine.tiny_default import ensure_tiny_default

INSTRUCTION = params.BY_NAME["instruction"].default
BUDGET = 256  # 7 frames after the 18-token prefix: a few chunks without eviction, then FIFO eviction
QUANTIZED = ("int8", "fp8", "int4")


def quiet(_msg: str) -> None:
    pass


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    ckpt = ensure_tiny_default(tmp_path_factory.mktemp("cache"))
    cfg = ModelConfig.from_json(ckpt)
    return ckpt, cfg, load_checkpoint(ckpt, cfg)


def engine_params(ckpt, **kw):
    return {"backend": "numpy", "checkpoint": str(ckpt), "kv_budget_tokens": BUDGET, "eviction_policy": "fifo",
            **kw}


def twin_kv(cfg):
    return KVManager(BUDGET, cfg.n_patches, len(INSTRUCTION.encode()), policy="fifo", embed_dim=cfg.hidden_size)


def images(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (64, 128, 3), dtype=np.uint8) for _ in range(n)]


def oracle_weights(w, weight_dtype):
    return w if weight_dtype == "bf16" else Q.quantize_weights(w, weight_dtype).dequantized()


def assert_same_chunks(a, b, frames, tag):
    """a and b run the same frames and give bit-identical tokens, logits and actions."""
    for fid, img in enumerate(frames):
        ra, rb = a.run_chunk(a.encode_frame(img), fid), b.run_chunk(b.encode_frame(img), fid)
        assert np.array_equal(ra.token_ids, rb.token_ids), f"{tag}: frame {fid}: tokens differ"
        assert np.array_equal(a.last_logits, b.last_logits), f"{tag}: frame {fid}: logits differ"
        assert np.array_equal(ra.action, rb.action) and ra.evicted_frames == rb.evicted_frames, tag


# ---- end to end through make_engine -------------------------------------------------------------------------------

@pytest.mark.parametrize("weight_dtype", Q.WEIGHT_DTYPES)
def test_each_weight_dtype_computes_the_oracle_arithmetic(tiny, weight_dtype):
    ckpt, cfg, w = tiny
    logs = []
    eng = make_engine(engine_params(ckpt, weight_dtype=weight_dtype), log=logs.append)
    oracle_w = oracle_weights(w, weight_dtype)
    name = "model.layers.1.mlp.down_proj.weight"
    # the engine holds the dequantised weights, and for a quantised dtype they are not the bf16 ones
    assert np.array_equal(eng.layers[1].wd_t, oracle_w[name].T)
    assert np.array_equal(oracle_w[name], w[name]) == (weight_dtype == "bf16")
    if weight_dtype != "bf16":
        assert any(f"weight_dtype {weight_dtype} (quantised at load)" in m for m in logs), logs
    twin = NumpyEngine(cfg, oracle_w, twin_kv(cfg), instruction=INSTRUCTION, decode_tokens=8)
    frames = images(9)  # 9 > 7 frames of budget: FIFO evicts on the last ones
    assert_same_chunks(eng, twin, frames, weight_dtype)

    # the float64 reference on the same dequantised weights: same semantics, not just the same code
    eng = make_engine(engine_params(ckpt, weight_dtype=weight_dtype), log=quiet)
    stream = R.start_stream(cfg, oracle_w, twin_kv(cfg), INSTRUCTION, decode_tokens=8)
    for fid, img in enumerate(frames[:4]):
        tokens = eng.encode_frame(img)
        res = eng.run_chunk(tokens, fid)
        ref = R.reference_chunk(stream, tokens, fid)
        scale = 1.0 + np.abs(ref.logits).max()
        err = np.abs(eng.last_logits - ref.logits).max() / scale
        assert err < 1e-4, f"{weight_dtype} frame {fid}: logits differ from the reference by {err:.2e}"
        srt = np.sort(ref.logits, axis=1)
        clear = (srt[:, -1] - srt[:, -2]) > 1e-3 * scale
        assert np.array_equal(res.token_ids[clear], ref.token_ids[clear]), f"{weight_dtype} frame {fid}"


def test_bf16_leaves_the_weights_and_the_engine_as_they_were(tiny):
    ckpt, cfg, w = tiny
    assert dequantized_weights(cfg, w, "bf16") is w  # no copy, no rounding: the path before issue 23
    by_default = make_engine(engine_params(ckpt), log=quiet)  # no weight_dtype given
    explicit = make_engine(engine_params(ckpt, weight_dtype="bf16"), log=quiet)
    old_call = NumpyEngine(cfg, load_checkpoint(ckpt, cfg), twin_kv(cfg), instruction=INSTRUCTION, decode_tokens=8)
    frames = images(3, seed=1)
    assert_same_chunks(by_default, old_call, frames, "default vs the constructor without weight_dtype")
    assert_same_chunks(explicit, NumpyEngine(cfg, w, twin_kv(cfg), instruction=INSTRUCTION), frames, "bf16")


@pytest.mark.parametrize("weight_dtype", QUANTIZED)
def test_a_prequantized_checkpoint_runs_as_quantising_at_load_does(tiny, tmp_path, weight_dtype):
    ckpt, cfg, w = tiny
    cfg_dict = json.loads((ckpt / "config.json").read_text())
    QC.write_quantized_checkpoint(tmp_path / "q", cfg_dict, Q.quantize_weights(w, weight_dtype))
    logs = []
    pre = make_engine(engine_params(tmp_path / "q", weight_dtype=weight_dtype), log=logs.append)
    assert any("pre-quantised checkpoint" in m for m in logs), logs
    at_load = make_engine(engine_params(ckpt, weight_dtype=weight_dtype), log=quiet)
    assert_same_chunks(pre, at_load, images(3, seed=2), weight_dtype)
    assert pre.memory()["device_weight_bytes"] == at_load.memory()["device_weight_bytes"]


def test_the_command_line_writes_the_checkpoint_the_engine_reads(tiny, tmp_path, capsys):
    """python -m vla_edge_ros.engine.quant_checkpoint SRC DST --weight-dtype int4: the engine on DST runs as the one
    quantising SRC at load; an existing DST, a pre-quantised SRC and a bad type are refused, nothing overwritten."""
    ckpt, cfg, w = tiny
    assert QC.main([str(ckpt), str(tmp_path / "q4"), "--weight-dtype", "int4"]) == 0
    assert "linear weights as int4" in capsys.readouterr().out
    assert QC.read_quantization_block(tmp_path / "q4")["weight_dtype"] == "int4"
    pre = make_engine(engine_params(tmp_path / "q4", weight_dtype="int4"), log=quiet)
    at_load = make_engine(engine_params(ckpt, weight_dtype="int4"), log=quiet)
    assert_same_chunks(pre, at_load, images(2, seed=5), "cli int4")
    before = (tmp_path / "q4" / "model.quantized.safetensors").stat().st_mtime_ns
    assert QC.main([str(ckpt), str(tmp_path / "q4"), "--weight-dtype", "int8"]) == 2  # exists, not empty
    assert QC.main([str(tmp_path / "q4"), str(tmp_path / "again"), "--weight-dtype", "int8"]) == 2  # already codes
    out = capsys.readouterr().out
    assert "exists and is not empty" in out and "already a pre-quantised checkpoint" in out
    assert (tmp_path / "q4" / "model.quantized.safetensors").stat().st_mtime_ns == before
    assert not (tmp_path / "again").exists()
    with pytest.raises(SystemExit):
        QC.main([str(ckpt), str(tmp_path / "q0"), "--weight-dtype", "bf16"])


# ---- refusals -----------------------------------------------------------------------------------------------------

def test_a_bad_weight_dtype_is_refused_by_name(tiny):
    ckpt, cfg, w = tiny
    with pytest.raises(EngineError, match=r"weight_dtype='int3' is not one of bf16, int8, fp8, int4"):
        make_engine(engine_params(ckpt, weight_dtype="int3"), log=quiet)
    with pytest.raises(EngineError, match=r"weight_dtype='fp16' is not one of"):
        NumpyEngine(cfg, w, twin_kv(cfg), instruction=INSTRUCTION, weight_dtype="fp16")
    assert params.WEIGHT_DTYPES == Q.WEIGHT_DTYPES and params.BY_NAME["weight_dtype"].default == "bf16"
    assert params.BY_NAME["weight_dtype"].node == params.INFERENCE and not params.BY_NAME["weight_dtype"].live


def test_a_prequantized_checkpoint_in_another_weight_dtype_is_refused(tiny, tmp_path):
    ckpt, cfg, w = tiny
    cfg_dict = json.loads((ckpt / "config.json").read_text())
    QC.write_quantized_checkpoint(tmp_path, cfg_dict, Q.quantize_weights(w, "int8"))
    for asked in ("int4", "bf16"):
        with pytest.raises(EngineError, match=rf"pre-quantised as int8 but weight_dtype='{asked}'"):
            make_engine(engine_params(tmp_path, weight_dtype=asked), log=quiet)
    with pytest.raises(EngineError, match=r"quantised as int8, weight_dtype='fp8' was asked"):
        NumpyEngine(cfg, Q.quantize_weights(w, "int8"), twin_kv(cfg), instruction=INSTRUCTION, weight_dtype="fp8")


def test_the_cuda_backend_takes_every_weight_type_and_make_engine_hands_it_over(tiny, monkeypatch):
    ckpt, cfg, w = tiny
    for wd in Q.WEIGHT_DTYPES:  # its kernels (cuda/wtype.cuh; GPU tests: test_cuda_quant.py)
        assert unsupported_reason(cfg, wd) is None
    assert "is not one of" in unsupported_reason(cfg, "int2")
    # the constructor refuses an unknown type before it touches CUDA (so this runs without a GPU) ...
    with pytest.raises(EngineError, match=r"weight_dtype='int2' is not one of"):
        CudaEngine(cfg, w, twin_kv(cfg), instruction=INSTRUCTION, weight_dtype="int2")
    # ... and make_engine hands weight_dtype to it (a stand-in cuda_backend that reports a GPU and records)
    seen = []

    class Recorder:
        def __init__(self, *args, **kw):
            seen.append(kw.get("weight_dtype"))
            raise EngineError("recorded")

    mod = types.ModuleType("vla_edge_ros.engine.cuda_backend")
    mod.cuda_available, mod.CudaEngine = (lambda: True), Recorder
    monkeypatch.setitem(sys.modules, "vla_edge_ros.engine.cuda_backend", mod)
    import vla_edge_ros.engine as pkg
    monkeypatch.setattr(pkg, "cuda_backend", mod, raising=False)
    for wd in ("fp8", "int4"):
        with pytest.raises(EngineError, match="recorded"):
            make_engine({**engine_params(ckpt, weight_dtype=wd), "backend": "cuda"}, log=quiet)
    assert seen == ["fp8", "int4"]


def test_the_int4_pair_knob_is_refused_by_name_where_k_is_not_a_multiple_of_64():
    """GEMM_I4_PAIR=1 (cuda/gemm_quant.cu) walks K in units of 64 columns: a model whose hidden or padded intermediate
    size is not a multiple of 64 would silently drop the tail, so the engine refuses the build, naming the size."""
    from vla_edge_ros.engine.config import qwen2_5_1_5b_dict
    qwen = ModelConfig.from_json(qwen2_5_1_5b_dict())
    odd = ModelConfig.from_json({**qwen2_5_1_5b_dict(), "intermediate_size": 8960 + 32})
    assert defines_problem(qwen, "int4", ["GEMM_I4_PAIR=1"]) is None
    assert defines_problem(odd, "int4", []) is None and defines_problem(odd, "int8", ["GEMM_I4_PAIR=1"]) is None
    assert defines_problem(odd, "int4", ["GEMM_I4_PAIR=0"]) is None
    why = defines_problem(odd, "int4", ["VLA_TIMELINE", "GEMM_I4_PAIR=1"])
    assert why and "multiple of 64" in why and f"intermediate {padded_intermediate(odd)}" in why


@pytest.mark.parametrize("weight_dtype", ["int8", "fp8", "int4"])
def test_the_cuda_engine_reads_a_prequantised_checkpoint_as_the_codes_it_would_make_at_load(tiny, tmp_path,
                                                                                            weight_dtype):
    """CudaEngine._load_weights (host side, no GPU): quantising the bf16 checkpoint at load and reading the
    pre-quantised one give byte-equal codes, scales and zero points, and equal dense tensors."""
    ckpt, cfg, w = tiny
    cfg_dict = json.loads((Path(ckpt) / "config.json").read_text())
    QC.write_quantized_checkpoint(tmp_path, cfg_dict, Q.quantize_weights(w, weight_dtype))
    me = types.SimpleNamespace(cfg=cfg, weight_dtype=weight_dtype)
    at_load, read = CudaEngine._load_weights(me, ckpt), CudaEngine._load_weights(me, tmp_path)
    assert set(at_load) == set(read)
    quantised = [k for k in at_load if hasattr(at_load[k], "codes")]
    assert quantised and all(Q.is_quantized_name(k) for k in quantised)
    for k in at_load:
        x, y = at_load[k], read[k]
        if k in quantised:
            assert x.weight_dtype == y.weight_dtype == weight_dtype
            for f in ("codes", "scales", "zeros"):
                u, v = getattr(x, f), getattr(y, f)
                assert (u is None) == (v is None), (k, f)
                if u is not None:
                    assert u.dtype == v.dtype and np.array_equal(u, v), (k, f)
        else:
            assert np.array_equal(x, y), k


# ---- the memory count ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("weight_dtype", Q.WEIGHT_DTYPES)
def test_the_numpy_engine_reports_the_size_a_gpu_would_hold(tiny, weight_dtype):
    ckpt, cfg, w = tiny
    eng = make_engine(engine_params(ckpt, weight_dtype=weight_dtype), log=quiet)
    model = Q.quantize_weights(w, weight_dtype)  # real containers: codes + scales + zeros, the rest in bf16
    mem = eng.memory()
    assert mem["device_weight_bytes"] == model.total_bytes()
    # what it holds is float32 copies, whatever the dtype: more than the quantised figure
    assert mem["current_bytes"] > 2 * model.total_bytes()


def test_quantised_sizes_order_and_the_linear_shapes_are_the_checkpoints(tiny):
    _, cfg, w = tiny
    shapes = expected_shapes(cfg, include_vision=True)
    sizes = {wd: Q.weights_nbytes(shapes, wd) for wd in Q.WEIGHT_DTYPES}
    assert sizes["int4"] < sizes["int8"] == sizes["fp8"] < sizes["bf16"] == 2 * sum(a.size for a in w.values())
    linear = Q.linear_shapes(cfg)
    assert linear == {n: s for n, s in expected_shapes(cfg).items() if Q.is_quantized_name(n)}
    for wd in Q.WEIGHT_DTYPES:
        assert Q.weights_nbytes(linear, wd) == Q.quantize_weights(w, wd).linear_bytes()


def small_cfg(intermediate):
    d = tiny_default_dict()
    d.update(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=intermediate)
    return ModelConfig.from_json(d)


@pytest.mark.parametrize("weight_dtype", Q.WEIGHT_DTYPES)
def test_the_cuda_plan_counts_its_padded_linear_weights_at_their_quantised_size(weight_dtype):
    cfg = small_cfg(intermediate=100)  # padded to 128 by the kernels' layout
    inter = padded_intermediate(cfg)
    assert inter > cfg.intermediate_size
    bf16_model = memory_plan(cfg, 256, 8)["model"]
    got = quantized_model_bytes(bf16_model, cfg, weight_dtype, inter)
    # independently: quantise real (zero) matrices of the padded shapes and count their containers
    shapes = Q.linear_shapes(cfg, inter)
    containers = sum(Q.quantize_linear(np.zeros(s, np.float32), weight_dtype).bytes() for s in shapes.values())
    assert got == bf16_model - sum(2 * a * b for a, b in shapes.values()) + containers
    assert (got == bf16_model) == (weight_dtype == "bf16")


def test_the_vram_check_refuses_bf16_where_int8_fits():
    from vla_edge_ros.engine.config import qwen2_5_1_5b_dict
    cfg = ModelConfig.from_json(qwen2_5_1_5b_dict())
    sizes = memory_plan(cfg, 4096, 8)
    totals = {wd: quantized_model_bytes(sizes["model"], cfg, wd, padded_intermediate(cfg)) + sizes["kv"]
              + sizes["scratch"] for wd in ("bf16", "int8")}
    limit_gb = (totals["bf16"] + totals["int8"]) / 2 / GIB
    model = {wd: totals[wd] - sizes["kv"] - sizes["scratch"] for wd in totals}
    assert check_budget(model["int8"], sizes["kv"], sizes["scratch"], limit_gb) == totals["int8"]
    with pytest.raises(EngineError, match="refusing to start"):
        check_budget(model["bf16"], sizes["kv"], sizes["scratch"], limit_gb)


def test_make_engine_takes_weight_dtype_among_all_the_nodes_parameters(tiny):
    """The node passes all its parameters: weight_dtype among them must reach the engine (not be dropped)."""
    ckpt, _, _ = tiny
    eng = make_engine({**params.defaults(params.INFERENCE), **engine_params(ckpt, weight_dtype="fp8")}, log=quiet)
    assert eng.weight_dtype == "fp8" and eng.memory()["device_weight_bytes"] < make_engine(
        engine_params(ckpt), log=quiet).memory()["device_weight_bytes"]
