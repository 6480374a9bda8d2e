"""The CUDA engine against HF transformers over a generated sweep of Qwen2 geometries (GPU; marked ``gpu``).

Why a sweep: the kernels are specialised by head_dim and by how many query heads share a KV head (G), and a
geometry that only the tests' two fixed models do not have (Qwen2.5-3B and up: G = 8 and 7 at head_dim 128) was
once refused at configure without the README saying so. Every case here is a small random-weight
``Qwen2ForCausalLM`` built from HF's own ``Qwen2Config``: its ``config.json`` is the one transformers writes
(5.x: the RoPE base inside ``rope_parameters``), read by ``ModelConfig`` from the file as a user's checkpoint
would be; the weights are this package's random bf16 safetensors. Swept: G = 1..8 at head_dim 64 and 128 (the
head-group kernels past 6 per block at 128), tied and untied LM heads, rope_theta 1e4 / 5e5 / 1e6, 2-3 layers,
plus G = 12 and 16 (head groups in the decode attention too) and an intermediate size off the kernels' quantum
(padded). Each case: three frames through ``CudaEngine.run_chunk`` (no eviction, so HF's causal recompute of the
whole sequence is the exact reference), cosine >= 0.999 of the final hidden state of the frame's 32 prefill rows,
of each of the 8 decode steps and of the action-row logits.

Skipped without PyCUDA / a GPU / torch / transformers. CPU-side geometry coverage: test/test_cuda_plan.py.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from vla_edge_ros.engine.config import ModelConfig
from vla_edge_ros.engine.cuda.plan import LaunchConstants

pytestmark = pytest.mark.gpu

INSTRUCTION = "pick up the red block"  # 21 bytes -> 21 pinned prefix tokens
N_FRAMES = 3
BUDGET = 21 + 11 + 32 * 4  # room for 4 frames: no eviction over N_FRAMES
THETAS = (1e4, 1e6, 5e5)


def _cases() -> list[dict]:
    """The generated sweep: every G in 1..8 at both head dims, the other knobs cycling so each value meets several
    geometries; then the extras past one decode block and a padded intermediate size."""
    out = []
    i = 0
    for hd in (64, 128):
        for G in range(1, 9):
            # hidden = G x KV heads x head_dim, kept <= 2048; 2 KV heads where that fits (the head-group kernels
            # index KV heads too: Qwen2.5-7B has 4 with G = 7)
            n_kvh = 2 if G * hd <= 512 or G >= 7 else 1
            out.append(dict(hd=hd, G=G, n_kvh=n_kvh, tie=i % 2 == 0, theta=THETAS[i % 3], layers=2 + i % 2,
                            inter=256 + 64 * (i % 3)))
            i += 1
    out.append(dict(hd=64, G=16, n_kvh=1, tie=False, theta=1e4, layers=2, inter=320))   # decode head groups
    out.append(dict(hd=128, G=12, n_kvh=1, tie=True, theta=5e5, layers=2, inter=256))   # both attentions grouped
    out.append(dict(hd=128, G=8, n_kvh=2, tie=False, theta=1e6, layers=3, inter=200))   # 3B-like, I padded to 224
    return out


CASES = _cases()


def _case_id(c: dict) -> str:
    return (f"hd{c['hd']}-G{c['G']}-kv{c['n_kvh']}-{'tied' if c['tie'] else 'untied'}-theta{c['theta']:g}"
            f"-L{c['layers']}-I{c['inter']}")


def hf_config(c: dict):
    """HF's own Qwen2Config for a case (transformers 4.x takes rope_theta, 5.x rope_parameters)."""
    from transformers import Qwen2Config
    heads = c["G"] * c["n_kvh"]
    kwargs = dict(vocab_size=640, hidden_size=heads * c["hd"], intermediate_size=c["inter"],
                  num_hidden_layers=c["layers"], num_attention_heads=heads, num_key_value_heads=c["n_kvh"],
                  max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=c["tie"], hidden_act="silu",
                  use_sliding_window=False, attn_implementation="eager")
    try:
        conf = Qwen2Config(**kwargs, rope_theta=c["theta"])
    except TypeError:  # RoPE settings only through rope_parameters
        conf = Qwen2Config(**kwargs, rope_parameters={"rope_type": "default", "rope_theta": c["theta"]})
    rp = getattr(conf, "rope_parameters", None)
    if isinstance(rp, dict):
        rp["rope_theta"] = c["theta"]
    return conf


def write_checkpoint(torch, conf, path, seed: int) -> tuple[ModelConfig, dict]:
    """config.json as transformers writes it (+ the vla block, defaults), random bf16 weights as safetensors."""
    from safetensors.torch import save_file
    from vla_edge_ros.bench.gpu_chunk_bench import random_weights
    path.mkdir(parents=True, exist_ok=True)
    d = json.loads(conf.to_json_string())
    d["vla"] = {}
    (path / "config.json").write_text(json.dumps(d))
    cfg = ModelConfig.from_json(path)  # from the file, as a user's checkpoint is read
    tensors = random_weights(torch, cfg, seed)
    save_file({k: v.cpu() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return cfg, tensors


def cosine(a, b) -> float:
    a = np.asarray(a, np.float64).ravel()
    b = np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_geometry_matches_hf(torch_cuda, tmp_path, case):
    torch = torch_cuda
    pytest.importorskip("transformers")
    from transformers import Qwen2ForCausalLM
    from vla_edge_ros.core.kv.manager import KVManager
    from vla_edge_ros.engine.cuda import CudaEngine
    conf = hf_config(case)
    cfg, tensors = write_checkpoint(torch, conf, tmp_path / "ckpt", seed=CASES.index(case) + 10)
    G, HD = case["G"], case["hd"]
    assert (cfg.head_dim, cfg.n_groups, cfg.tie_word_embeddings) == (HD, G, case["tie"])
    assert cfg.rope_theta == case["theta"]  # wherever transformers wrote it
    kv = KVManager(BUDGET, cfg.n_patches, len(INSTRUCTION.encode()), policy="fifo", embed_dim=cfg.hidden_size)
    eng = CudaEngine(cfg, tmp_path / "ckpt", kv, instruction=INSTRUCTION, decode_tokens=8, max_vram_gb=8.0,
                     log=lambda m: None)
    try:
        # the sweep reaches the head-group kernels exactly where one block cannot hold the KV head's heads
        c = LaunchConstants()
        pf_max = min(c.PF_MAXG_128 if HD == 128 else c.PF_MAXG_64,
                     65536 // (64 * eng.limits.prefill_attn_regs))
        assert eng.plan.attn_prefill.kernel.endswith("_hg") == (G > pf_max), eng.plan.attn_prefill
        assert eng.plan.attn_decode.kernel.endswith("_hg") == (G > c.DEC_MAXG), eng.plan.attn_decode
        rng = np.random.default_rng(CASES.index(case))
        frames = [(0.02 * rng.standard_normal((32, cfg.hidden_size))).astype(np.float32) for _ in range(N_FRAMES)]
        for f, x in enumerate(frames):
            res = eng.run_chunk(x, f)
        assert res.evicted_frames == [] and kv.frames == list(range(N_FRAMES))
        fin_pf, fin_dec = eng.read_final_hidden()
        logits, gen = eng.last_logits, res.token_ids
    finally:
        eng.close()
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(conf).to(torch.float32)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    assert not unexpected, unexpected
    assert all(("lm_head" in m and case["tie"]) or "rotary" in m for m in missing), missing
    model.eval()
    emb = tensors["model.embed_tokens.weight"].float()
    head = (emb if case["tie"] else tensors["lm_head.weight"].float())[cfg.action_token_offset:]
    seq = torch.cat([emb[torch.tensor(list(INSTRUCTION.encode()), device="cuda")]]
                    + [torch.from_numpy(x).cuda() for x in frames] + [emb[torch.from_numpy(gen[:8]).cuda()]])
    with torch.no_grad():
        hs = model.model(inputs_embeds=seq[None]).last_hidden_state[0]
    ref_logits = (hs @ head.T).double().cpu().numpy()
    hs = hs.double().cpu().numpy()
    n_ctx = 21 + 32 * N_FRAMES
    report = [("prefill hidden (32 rows)", cosine(fin_pf, hs[n_ctx - 32:n_ctx])),
              ("prefill action logits", cosine(logits[0], ref_logits[n_ctx - 1]))]
    for i in range(1, 9):
        report.append((f"decode {i} hidden", cosine(fin_dec[i - 1], hs[n_ctx + i - 1])))
        report.append((f"decode {i} action logits", cosine(logits[i], ref_logits[n_ctx + i - 1])))
    print(f"\n[{_case_id(case)}] {eng.plan.attn_prefill.kernel} {eng.plan.attn_prefill.grid[1:]} / "
          f"{eng.plan.attn_decode.kernel}: worst cosine vs HF {min(c for _, c in report):.6f}")
    bad = [(n, c) for n, c in report if not c >= 0.999]
    assert not bad, bad
    np.testing.assert_array_equal(gen, np.argmax(logits, axis=1) + cfg.action_token_offset)
