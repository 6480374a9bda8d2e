"""The CUDA engine as a whole.

GPU tests (marked ``gpu``, skipped without PyCUDA / a GPU):
* against HF transformers ``Qwen2ForCausalLM`` (float32, same random-weight bf16 safetensors written here) for
  the Qwen2.5-1.5B and 0.5B geometries: cosine >= 0.999 of the final hidden state of the 32 prefill rows and of
  each of the 8 decode steps, and of the action-row logits;
* against the numpy reference backend on the tiny geometry with eviction (semantic and fifo), a budget
  shrink (K/V relocation), graphs on and off, PDL on and off, and tuning variants.
CPU tests: the VRAM budget check and tracker, the gate/up interleave, backend probing (the launch planner:
test_cuda_plan.py).
"""
from __future__ import annotations

import numpy as np
import pytest

from vla_edge_ros.engine.config import ModelConfig, qwen2_5_0_5b_dict, qwen2_5_1_5b_dict, tiny_default_dict
from vla_edge_ros.engine.cuda import cuda_available, cuda_status
from vla_edge_ros.engine.cuda.buffers import interleave_gate_up
from vla_edge_ros.engine.cuda.vram import VramTracker, check_budget
from vla_edge_ros.engine.interface import EngineError

INSTRUCTION = "pick up the red block"  # 21 bytes -> 21 pinned prefix tokens


# ---------------------------------------------------------------------------------------------------- CPU
def test_check_budget_refuses_with_parts_named():
    assert check_budget(1 << 30, 1 << 28, 1 << 20, 8.0) == (1 << 30) + (1 << 28) + (1 << 20)
    with pytest.raises(EngineError) as e:
        check_budget(7 << 30, 1 << 30, 1 << 20, 8.0)
    msg = str(e.value)
    assert "max_vram_gb=8.0" in msg and "model 7.000" in msg and "KV cache 1.000" in msg
    with pytest.raises(EngineError):
        check_budget(-1, 0, 0, 8.0)
    with pytest.raises(EngineError):
        check_budget(1, 0, 0, 0.0)


def test_vram_tracker_counts_current_and_peak():
    freed = []
    tr = VramTracker(lambda n: ("h", n), lambda h: freed.append(h), limit_bytes=1000)
    tr.alloc("a", 400)
    tr.alloc("b", 500)
    assert tr.stats() == {"current_bytes": 900, "peak_bytes": 900, "allocations": 2}
    with pytest.raises(EngineError, match="over its limit"):
        tr.alloc("c", 200)
    with pytest.raises(EngineError, match="already exists"):
        tr.alloc("a", 10)
    tr.free("a")
    tr.alloc("c", 200)
    assert (tr.current_bytes, tr.peak_bytes) == (700, 900)
    tr.free_all()
    assert tr.current_bytes == 0 and freed == [("h", 400), ("h", 500), ("h", 200)]

    def boom(n):
        raise RuntimeError("out of memory")
    with pytest.raises(EngineError, match="out of memory"):
        VramTracker(boom).alloc("x", 10)


def test_interleave_gate_up_layout():
    gate = np.arange(16 * 3).reshape(16, 3)
    up = -np.arange(16 * 3).reshape(16, 3) - 1
    w = interleave_gate_up(gate, up)
    assert w.shape == (32, 3)
    np.testing.assert_array_equal(w[0:8], gate[0:8])
    np.testing.assert_array_equal(w[8:16], up[0:8])
    np.testing.assert_array_equal(w[16:24], gate[8:16])
    np.testing.assert_array_equal(w[24:32], up[8:16])
    with pytest.raises(EngineError):
        interleave_gate_up(gate[:12], up[:12])


def test_probe_never_raises_and_explains():
    ok, why = cuda_status()
    assert isinstance(ok, bool) and cuda_available() is ok
    if not ok:
        assert why  # a reason an operator can read


# ---------------------------------------------------------------------------------------------------- GPU
gpu = pytest.mark.gpu


def random_checkpoint(torch, cfg_dict: dict, path, seed: int) -> dict:
    """Random bf16 weights (GPU-generated, the benchmark's generator), written as safetensors with config.json;
    returns torch tensors."""
    from safetensors.torch import save_file
    import json
    from vla_edge_ros.bench.gpu_chunk_bench import random_weights
    tensors = random_weights(torch, ModelConfig.from_json(cfg_dict), seed)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg_dict))
    save_file({k: v.cpu() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return tensors


def hf_model(torch, cfg_dict: dict, tensors: dict):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "rope_theta", "rms_norm_eps", "tie_word_embeddings")
    kwargs = {k: cfg_dict[k] for k in keys}
    try:
        conf = Qwen2Config(**kwargs, hidden_act="silu", use_sliding_window=False, attn_implementation="eager")
    except TypeError:  # newer transformers: RoPE settings only through rope_parameters
        theta = kwargs.pop("rope_theta")
        conf = Qwen2Config(**kwargs, hidden_act="silu", use_sliding_window=False, attn_implementation="eager",
                           rope_parameters={"rope_type": "default", "rope_theta": theta})
    rp = getattr(conf, "rope_parameters", None)
    if isinstance(rp, dict):
        rp["rope_theta"] = cfg_dict["rope_theta"]
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(conf).to(torch.float32)
    sd = {k: v.float() for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected
    assert all("lm_head" in m or "rotary" in m for m in missing), missing
    model.eval()
    return model


def cosine(a, b) -> float:
    a = np.asarray(a, np.float64).ravel()
    b = np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def make_engine(cfg_dict, ckpt, budget, policy="fifo", use_graphs=True, instruction=INSTRUCTION, **kw):
    from vla_edge_ros.core.kv.manager import KVManager
    from vla_edge_ros.engine.cuda import CudaEngine
    cfg = ModelConfig.from_json(cfg_dict)
    kv = KVManager(budget, cfg.n_patches, len(instruction.encode()), policy=policy, embed_dim=cfg.hidden_size)
    return cfg, kv, CudaEngine(cfg, ckpt, kv, instruction=instruction, decode_tokens=8, max_vram_gb=16.0,
                               log=lambda m: None, use_graphs=use_graphs, **kw)


# The least cosine with HF (bf16 weights, fp32 arithmetic) per pass and weight type. bf16: the engine's own error.
# Quantised: the quantisation error of engine/quant.py's round-to-nearest codes (the kernels equal the numpy oracle
# to 0.99995: test_cuda_quant.py), accumulated over 7 matrices x 28 layers of RANDOM weights. Measured on the H200
# (worst pass, 1.5B / 0.5B): int8 0.9974 / 0.9989, fp8 0.9682 / 0.9886, int4 0.6906 / 0.8346 -- below issue 23's
# goals (0.999 int8 / fp8, 0.99 int4); the bounds here sit under the measured values to catch a kernel regression.
# The frames were drawn unseeded until session 23, when one run's 1.5B int8 worst pass was 0.99595 (decode 8's
# logits; the frames move the figure by ~1e-3): they are seeded now, and the int8 bound leaves that spread.
MIN_COSINE_VS_HF = {"bf16": 0.999, "int8": 0.995, "fp8": 0.96, "int4": 0.65}


@gpu
@pytest.mark.parametrize("geometry,arch,weight_dtype", [
    ("1.5b", "", "bf16"), ("0.5b", "", "bf16"),
    # the build for pre-Hopper GPUs (A100 sm_80, Jetson Orin sm_87): PTX for that architecture, compiled by the
    # driver for this GPU, so the code without PDL runs here (engine/cuda/arch.py)
    ("1.5b", "compute_80", "bf16"), ("0.5b", "compute_87", "bf16"),
    # quantised weights against HF's bf16 model (issue 23's quality goal, per pass)
    ("1.5b", "", "int8"), ("0.5b", "", "int8"), ("1.5b", "", "fp8"), ("0.5b", "", "fp8"),
    ("1.5b", "", "int4"), ("0.5b", "", "int4"), ("0.5b", "compute_87", "int4")])
def test_whole_model_matches_hf(torch_cuda, tmp_path, monkeypatch, geometry, arch, weight_dtype):
    torch = torch_cuda
    monkeypatch.setenv("VLA_CUDA_ARCH", arch)
    cfg_dict = qwen2_5_1_5b_dict() if geometry == "1.5b" else qwen2_5_0_5b_dict()
    tensors = random_checkpoint(torch, cfg_dict, tmp_path / geometry, seed=1 if geometry == "1.5b" else 2)
    n_frames = 6
    budget = 288  # 21 prefix + 8 frames (+11 spare): no eviction, so HF's causal recompute is the exact reference
    cfg, kv, eng = make_engine(cfg_dict, tmp_path / geometry, budget, weight_dtype=weight_dtype)
    assert (eng.arch.target, eng.pdl) == (("ptx", False) if arch else ("cubin", True))
    try:
        rng = np.random.default_rng(7)
        frames = [(0.02 * rng.standard_normal((32, cfg.hidden_size))).astype(np.float32) for _ in range(n_frames)]
        for f, x in enumerate(frames):
            res = eng.run_chunk(x, f)
        assert res.evicted_frames == [] and kv.frames == list(range(n_frames))
        fin_pf, fin_dec = eng.read_final_hidden()
        logits = eng.last_logits
        gen = res.token_ids
        model = hf_model(torch, cfg_dict, tensors)
        emb = tensors["model.embed_tokens.weight"].float()
        prefix = torch.tensor(list(INSTRUCTION.encode()), device="cuda")
        seq = torch.cat([emb[prefix]] + [torch.from_numpy(x).cuda() for x in frames]
                        + [emb[torch.from_numpy(gen[:8]).cuda()]])
        with torch.no_grad():
            hs = model.model(inputs_embeds=seq[None]).last_hidden_state[0]
        head = emb[cfg.action_token_offset:]
        ref_logits = (hs @ head.T).double().cpu().numpy()
        hs = hs.double().cpu().numpy()
        n_ctx = 21 + 32 * n_frames
        report = []
        c = cosine(fin_pf, hs[n_ctx - 32:n_ctx])
        report.append(("prefill hidden (32 rows)", c))
        report.append(("prefill action logits", cosine(logits[0], ref_logits[n_ctx - 1])))
        for i in range(1, 9):
            report.append((f"decode {i} hidden", cosine(fin_dec[i - 1], hs[n_ctx + i - 1])))
            report.append((f"decode {i} action logits", cosine(logits[i], ref_logits[n_ctx + i - 1])))
        print(f"\n[{geometry}{', ' + arch if arch else ''}, {weight_dtype}] cosine vs HF transformers (fp32):")
        for name, c in report:
            print(f"  {name:28s} {c:.6f}")
        bad = [(n, c) for n, c in report if not c >= MIN_COSINE_VS_HF[weight_dtype]]
        assert not bad, bad
        # the greedy chain follows the logits the engine itself produced
        off = cfg.action_token_offset
        np.testing.assert_array_equal(gen, np.argmax(logits, axis=1) + off)
    finally:
        eng.close()


@gpu
def test_pre_hopper_build_runs_the_tiny_model(torch_cuda, tmp_path, monkeypatch):
    """Built for sm_87 (Jetson Orin): no PDL, vs NumpyEngine over eviction."""
    from vla_edge_ros.core.kv.manager import KVManager
    from vla_edge_ros.engine.checkpoint import load_checkpoint
    from vla_edge_ros.engine.numpy_backend import NumpyEngine
    monkeypatch.setenv("VLA_CUDA_ARCH", "compute_87")
    cfg_dict = tiny_default_dict()
    random_checkpoint(torch_cuda, cfg_dict, tmp_path / "tiny", seed=4)
    budget = 21 + 11 + 32 * 4
    cfg, kv, eng = make_engine(cfg_dict, tmp_path / "tiny", budget, policy="semantic")
    assert not eng.pdl and eng.arch.build_cc == (8, 7) and not eng.arch.pdl
    ref = NumpyEngine(cfg, load_checkpoint(tmp_path / "tiny", cfg), KVManager(budget, 32, 21, policy="semantic",
                      embed_dim=cfg.hidden_size), instruction=INSTRUCTION, decode_tokens=8)
    try:
        rng = np.random.default_rng()
        for f in range(7):
            x = (0.05 * rng.standard_normal((32, cfg.hidden_size))).astype(np.float32)
            got, want = eng.run_chunk(x, f), ref.run_chunk(x, f)
            assert got.evicted_frames == want.evicted_frames
            c = cosine(eng.last_logits[0], ref.last_logits[0])
            assert c >= 0.999, (f, c)
    finally:
        eng.close()


@gpu
@pytest.mark.parametrize("policy,use_graphs,pdl,extra", [
    ("semantic", True, True, {}), ("fifo", True, True, {}), ("fifo", False, True, {}),
    ("sliding_window", True, False, {}), ("sliding_window", False, False, {}),
    ("semantic", True, True, {"late_trigger": "qkv,attn,combine,resid,gateup,gemm,rmsnorm,attn_pf"}),
    ("fifo", True, True, {"gemm_v4": "qkv,o,gateup,down"}),
    ("semantic", True, True, {"gemm_v4": "", "late_trigger": ""})])
def test_matches_numpy_backend_with_eviction(torch_cuda, tmp_path, policy, use_graphs, pdl, extra):
    """Tiny geometry, budget of 4 frames, 9 frames: eviction, slot reuse and a budget shrink, vs NumpyEngine.
    extra: tuning variants (every trigger late or none, every prefill GEMM on gemm32v4 or none of them)."""
    from vla_edge_ros.core.kv.manager import KVManager
    from vla_edge_ros.engine.checkpoint import load_checkpoint
    from vla_edge_ros.engine.numpy_backend import NumpyEngine
    torch = torch_cuda
    cfg_dict = tiny_default_dict()
    random_checkpoint(torch, cfg_dict, tmp_path / "tiny", seed=3)
    budget = 21 + 11 + 32 * 4  # 160
    cfg, kv, eng = make_engine(cfg_dict, tmp_path / "tiny", budget, policy=policy, use_graphs=use_graphs,
                               tuning={"pdl": pdl, **extra})
    assert eng.pdl == pdl
    weights = load_checkpoint(tmp_path / "tiny", cfg)
    kv_np = KVManager(budget, 32, 21, policy=policy, embed_dim=cfg.hidden_size)
    ref = NumpyEngine(cfg, weights, kv_np, instruction=INSTRUCTION, decode_tokens=8)
    try:
        rng = np.random.default_rng()
        base = rng.standard_normal((32, cfg.hidden_size)).astype(np.float32)
        worst = 1.0
        for f in range(9):
            x = (base + 0.5 * rng.standard_normal(base.shape)).astype(np.float32) * 0.05
            if f == 6:  # shrink: evicts and relocates frames beyond the new budget
                assert eng.kv.set_budget(21 + 11 + 32 * 3) == ref.kv.set_budget(21 + 11 + 32 * 3)
            got = eng.run_chunk(x, f, salient=(f % 4 == 0))
            want = ref.run_chunk(x, f, salient=(f % 4 == 0))
            assert got.evicted_frames == want.evicted_frames
            assert got.kv_occupancy_tokens == want.kv_occupancy_tokens
            # logits of every step agree; the greedy chains agree unless the reference had a near-tie (then the
            # chains legitimately diverge and later steps are not comparable)
            for i in range(9):
                c = cosine(eng.last_logits[i], ref.last_logits[i])
                worst = min(worst, c)
                assert c >= 0.999, (f, i, c)
                if got.token_ids[i] != want.token_ids[i]:
                    top2 = np.sort(ref.last_logits[i])[-2:]
                    assert top2[1] - top2[0] < 1e-2 * np.std(ref.last_logits[i]), (f, i, got.token_ids, want.token_ids)
                    break
            assert got.prefill_ms > 0 and got.decode_ms > 0
        print(f"\n[tiny {policy}, graphs {use_graphs}, pdl {pdl}, {extra or 'default tuning'}] worst logits cosine "
              f"vs numpy: {worst:.6f}")
        mem = eng.memory()
        assert 0 < mem["current_bytes"] <= mem["peak_bytes"]
    finally:
        eng.close()


@gpu
def test_retune_replans_and_keeps_the_results(torch_cuda, tmp_path):
    """retune re-plans and re-captures: the same frame on an empty cache gives the same logits with PDL off and
    every GEMM on gemm32v4 as with the defaults; an unknown or removed tuning key is refused by name."""
    cfg_dict = tiny_default_dict()
    random_checkpoint(torch_cuda, cfg_dict, tmp_path / "tiny", seed=6)
    cfg, kv, eng = make_engine(cfg_dict, tmp_path / "tiny", 21 + 11 + 32 * 4)
    try:
        x = (0.05 * np.random.default_rng(0).standard_normal((32, cfg.hidden_size))).astype(np.float32)
        eng.run_chunk(x, 0)
        good = eng.last_logits.copy()
        eng.retune(pdl=False, gemm_v4="qkv,o,gateup,down")
        assert not eng.pdl and eng.plan.gemm_qkv.kernel == "gemm32v4_atomic"
        eng.reset()
        eng.run_chunk(x, 1)
        for i in range(len(good)):
            assert cosine(eng.last_logits[i], good[i]) >= 0.9999, i
        with pytest.raises(EngineError, match="unknown tuning key"):
            eng.retune(decode_kernel="dataflow")
    finally:
        eng.close()


@gpu
def test_encode_frame_matches_patch_embedder(torch_cuda, tmp_path):
    from vla_edge_ros.engine.vision import PatchEmbedder
    torch = torch_cuda
    cfg_dict = tiny_default_dict()
    random_checkpoint(torch, cfg_dict, tmp_path / "tiny", seed=4)
    cfg, kv, eng = make_engine(cfg_dict, tmp_path / "tiny", 21 + 11 + 32 * 4)
    try:
        img = np.random.default_rng().integers(0, 256, (120, 160, 3), dtype=np.uint8)
        got = eng.encode_frame(img)
        want = PatchEmbedder(cfg)(img)  # no vision tensors in the checkpoint -> the seeded init on both sides
        assert got.shape == want.shape
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2
    finally:
        eng.close()


@gpu
def test_refuses_over_vram_budget(torch_cuda, tmp_path):
    torch = torch_cuda
    cfg_dict = tiny_default_dict()
    random_checkpoint(torch, cfg_dict, tmp_path / "tiny", seed=5)
    with pytest.raises(EngineError, match="max_vram_gb"):
        from vla_edge_ros.core.kv.manager import KVManager
        from vla_edge_ros.engine.cuda import CudaEngine
        cfg = ModelConfig.from_json(cfg_dict)
        kv = KVManager(21 + 11 + 32 * 4, 32, 21, embed_dim=cfg.hidden_size)
        CudaEngine(cfg, tmp_path / "tiny", kv, instruction=INSTRUCTION, max_vram_gb=0.001, log=lambda m: None)
