"""``gpu_chunk_bench --horizon-compare H`` (issue 22): an H-step action chunk of the benchmark's geometry and full
cache, decoded autoregressively and in parallel, the parallel engine timed under each of PARALLEL_VARIANTS' tunings
in turn: the slot pass on the 32-row kernels per tile or on the tiled GEMM over every tile (parallel_gemm), apart
from the frame's prefill or fused with it into one pass (fused_parallel). Printed as each variant finishes.
"""
from __future__ import annotations

import numpy as np

from vla_edge_ros.engine.config import ModelConfig

PARALLEL_VARIANTS = {  # --horizon-compare's parallel variants: tuning (the fused ones: frame and slots in one pass)
    "parallel": {"parallel_gemm": "tiles32", "fused_parallel": False},
    "parallel_tiled": {"parallel_gemm": "tiled", "fused_parallel": False},
    "fused": {"parallel_gemm": "tiles32", "fused_parallel": True},
    "fused_tiled": {"parallel_gemm": "tiled", "fused_parallel": True}}


def run_horizon_compare(cfg_dict, weights_np, args, log) -> dict:
    """GPU medians (prefill, decode, chunk) of an H = args.horizon_compare chunk, autoregressive (its own engine)
    and parallel, the parallel engine timed in turn under each of PARALLEL_VARIANTS' tunings (its cache filled to the
    budget once; same frames, same weights). A fused chunk is all prefill_ms (one pass)."""
    from vla_edge_ros.bench.gpu_chunk_bench import INSTRUCTION, pct  # (that module imports this one when asked)
    from vla_edge_ros.core.kv.manager import KVManager
    from vla_edge_ros.engine.cuda import CudaEngine
    out = {"horizon": args.horizon_compare}
    rng = np.random.default_rng(0)
    for decode in ("autoregressive", "parallel"):
        cfg = ModelConfig.from_json({**cfg_dict, "vla": {"action_horizon": args.horizon_compare,
                                                         "chunk_decode": decode}})
        frames = [(0.02 * rng.standard_normal((cfg.n_patches, cfg.hidden_size))).astype(np.float32)
                  for _ in range(8)]
        kv = KVManager(args.budget, cfg.n_patches, len(INSTRUCTION.encode()), policy=args.policy,
                       embed_dim=cfg.hidden_size)
        eng = CudaEngine(cfg, weights_np, kv, instruction=INSTRUCTION, decode_tokens=args.decode_tokens,
                         max_vram_gb=args.max_vram_gb, log=log)
        try:
            f = 0
            while eng.kv.occupancy_tokens + cfg.n_patches <= args.budget:  # fill the cache to the budget
                eng.run_chunk(frames[f % 8], f)
                f += 1
            for mode, tuning in (PARALLEL_VARIANTS.items() if decode == "parallel" else [(decode, None)]):
                if tuning:
                    eng.retune(**tuning)
                pf, dc = [], []
                for i in range(args.chunks):
                    r = eng.run_chunk(frames[(f + i) % 8] + np.float32(1e-3 * i), f + i)
                    pf.append(r.prefill_ms)
                    dc.append(r.decode_ms)
                f += args.chunks
                out[mode] = {"decode_steps": eng.decode_steps, "scratch_slots": eng.scratch_slots,
                             "prefill_median_ms": pct(pf, 50), "decode_median_ms": pct(dc, 50),
                             "gpu_median_ms": pct(np.add(pf, dc), 50), "chunks": args.chunks}
                r = out[mode]
                print(f"H={args.horizon_compare} {mode:14s}: {r['scratch_slots']} action/decode slots, GPU median "
                      f"{r['gpu_median_ms']:.3f} ms (prefill {r['prefill_median_ms']:.3f} + decode "
                      f"{r['decode_median_ms']:.3f})", flush=True)
        finally:
            eng.close()
    return out
