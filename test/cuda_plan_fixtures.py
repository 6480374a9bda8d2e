"""What test_cuda_plan.py, test_cuda_forward.py and test_cuda_fleet.py share (no GPU needed): the geometries and
device classes they plan for, and a chunk's launches recorded through a fake launcher over fake device pointers."""
from __future__ import annotations

import math
import types

from vla_edge_ros.engine.config import ModelConfig, qwen2_5_0_5b_dict, qwen2_5_1_5b_dict, tiny_default_dict
from vla_edge_ros.engine.cuda import forward
from vla_edge_ros.engine.cuda.kernels import BY_NAME
from vla_edge_ros.engine.cuda.pass_meta import META_INTS
from vla_edge_ros.engine.cuda.plan import DeviceLimits

GEOMETRIES = {"1.5b": qwen2_5_1_5b_dict, "0.5b": qwen2_5_0_5b_dict, "tiny": tiny_default_dict}


def _qwen(hidden, layers, heads, kv, inter, vocab=152064, tie=False):
    """A Qwen2.5 config.json's geometry (the published model cards' values)."""
    return lambda: {**qwen2_5_1_5b_dict(), "hidden_size": hidden, "num_hidden_layers": layers,
                    "num_attention_heads": heads, "num_key_value_heads": kv, "intermediate_size": inter,
                    "vocab_size": vocab, "tie_word_embeddings": tie}


# name -> (config, query heads per KV head)
QWEN2_5 = {"0.5b": (qwen2_5_0_5b_dict, 7), "1.5b": (qwen2_5_1_5b_dict, 6),
           "3b": (_qwen(2048, 36, 16, 2, 11008, 151936, True), 8), "7b": (_qwen(3584, 28, 28, 4, 18944), 7),
           "14b": (_qwen(5120, 48, 40, 8, 13824), 5), "32b": (_qwen(5120, 64, 40, 8, 27648), 5),
           "72b": (_qwen(8192, 80, 64, 8, 29568), 8)}
H200 = dict(sm_count=132, smem_optin=232448, pdl=True)
ORIN = dict(sm_count=16, smem_optin=166912, pdl=False)   # Jetson AGX Orin (sm_87)
RTX40 = dict(sm_count=58, smem_optin=101376, pdl=False)  # RTX 4070 / L4 class (sm_89)
PREFILL_REGS = {128: 168, 64: 126}  # registers of attn_prefill_hd{128,64} as compiled for sm_90 (ptxas -v)


def cfg_of(name: str, **over) -> ModelConfig:
    return ModelConfig.from_json({**GEOMETRIES[name](), **over})


def limits(device: dict, cfg: ModelConfig) -> DeviceLimits:
    return DeviceLimits(**device, prefill_attn_regs=PREFILL_REGS.get(cfg.head_dim, 0))


def covers(launch, N: int, K: int, rows_per_block: int) -> None:
    """Blocks x rows cover N, splits x split length cover K (split-K) with no split empty."""
    assert launch.grid[0] * rows_per_block >= N > (launch.grid[0] - 1) * rows_per_block
    if launch.ks:
        assert launch.grid[1] * launch.ks >= K > (launch.grid[1] - 1) * launch.ks


# ---- a chunk through a recording launcher
def fake_buffers(cfg: ModelConfig, slots: int, quantized: bool = False):
    from vla_edge_ros.engine.cuda.buffers import LayerWeights
    ptr = iter(range(1 << 20, 1 << 44, 1 << 20))
    NS = types.SimpleNamespace
    w = NS(layers=[LayerWeights(**{k: next(ptr) for k in LayerWeights._fields
                                   if quantized or k[0] not in "sz"})
                   for _ in range(cfg.num_hidden_layers)], embed=next(ptr), final_norm=next(ptr), head_rows=next(ptr),
           quantized=quantized)
    a = NS(**{n: next(ptr) for n in ("x_pre h_bf qkv attn_bf act_bf final_h x_dec q_dec attn_dec act_dec "
                                     "final_h_dec logits tok_buf meta meta_parallel forced").split()})
    a.meta_tile = lambda t: a.meta_parallel + 4 * META_INTS * t  # buffers.Activations.meta_tile
    kc, vc = next(ptr), next(ptr)
    kv = NS(nsplit=math.ceil(slots / 64), key_slots=next(ptr), rope=next(ptr), part_o_pf=next(ptr),
            part_ml_pf=next(ptr), part_o_dec=next(ptr), part_ml_dec=next(ptr),
            layer=lambda i: (kc + i * slots * 512, vc + i * slots * 512))
    return w, a, kv


def check_launch(launch, args) -> None:
    """One recorded launch against the kernel table: as many arguments as its signature, each of its type (P / i:
    int, f: float), every grid dimension >= 1."""
    sig = BY_NAME[launch.kernel].sig
    assert len(args) == len(sig), launch.kernel
    for c, v in zip(sig, args):
        assert isinstance(v, float) if c == "f" else isinstance(v, int), (launch.kernel, c, v)
    assert all(g >= 1 for g in launch.grid), launch


def record_chunk(cfg: ModelConfig, p, slots: int, quantized: bool = False, parallel_slots: int = 0,
                  with_args: bool = False) -> list[tuple]:
    """(kernel, grid, serial[, args]) of every launch of a chunk (parallel_slots > 0: the prefill and the parallel
    pass over that many slots, or the fused pass when p.fused_parallel), each checked against the table's
    signature."""
    w, a, kv = fake_buffers(cfg, slots, quantized)
    rec = []

    def k(launch, *args, serial=False):
        check_launch(launch, args)
        rec.append((launch.kernel, tuple(launch.grid), serial) + ((args, a) if with_args else ()))
    if parallel_slots and p.fused_parallel:
        forward.fused(k, p, cfg, w, a, kv, parallel_slots)
    elif parallel_slots:
        forward.prefill(k, p, cfg, w, a, kv)
        forward.parallel(k, p, cfg, w, a, kv, parallel_slots)
    else:
        forward.chunk(k, p, cfg, w, a, kv, 8)
    return rec
