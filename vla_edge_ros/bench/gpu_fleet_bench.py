"""One GPU serving N robots (issue 24): batched chunk time for N = 1, 2, 4, 8, 16 against the single-robot engine,
with each N's bandwidth floor, in one run.

    python -m vla_edge_ros.bench.gpu_fleet_bench [--robots 1,2,4,8,16] [--batches 30] [--budget 4096]
        [--geometry 1.5b|0.5b] [--json out.json]

Why: a chunk is memory-bound, so N robots in one pass should cost the weights once plus each robot's K/V, not N
chunks. Random bf16 weights of the Qwen2.5 geometry (no weights can be downloaded; the timing does not depend on
the values). Every robot's cache is filled to the budget first (eviction every chunk, as in steady state), then
``--batches`` batches of robots 0..N-1 are timed per N (GPU events of the two graph replays, and wall time from the
host). The single-robot figure is engine/cuda's CudaEngine on the same weights, budget and chunk shape, timed in
the same run. Floor per N: (1 + S) passes x (the weights once + every member's K/V rows) / the device-to-device
copy bandwidth measured here. Goal (issue 24): 8 robots in <= 1.5x the single-robot chunk time.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from vla_edge_ros.bench.fleet_bench import BatchTimer, robot_counts
from vla_edge_ros.bench.gpu_chunk_bench import INSTRUCTION, copy_bandwidth, pct, random_weights
from vla_edge_ros.engine.config import ModelConfig, qwen2_5_0_5b_dict, qwen2_5_1_5b_dict


def floor_bytes(cfg: ModelConfig, n: int, n_ctx: int, steps: int) -> int:
    """Bytes a batch of n robots must read: the linear weights and head rows once per pass, each robot's K/V of
    the keys its pass sees (the prefill: n_ctx, decode step i: n_ctx + i)."""
    H, I, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    nkv = cfg.num_key_value_heads * cfg.head_dim
    nqkv = cfg.num_attention_heads * cfg.head_dim + 2 * nkv
    weights = 2 * L * (nqkv * H + H * cfg.num_attention_heads * cfg.head_dim + 3 * I * H) + 2 * cfg.n_action_bins * H
    kv_token = 2 * 2 * L * nkv
    keys = n_ctx + sum(n_ctx + i for i in range(1, steps + 1))
    return int((1 + steps) * weights + n * kv_token * keys)


def main(argv: list[str] | None = None) -> int:
    """Batched CUDA chunk time for N robots vs one: python -m vla_edge_ros.bench.gpu_fleet_bench"""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--robots", type=robot_counts, default=[1, 2, 4, 8, 16])
    ap.add_argument("--batches", type=int, default=30, help="timed batches per N")
    ap.add_argument("--budget", type=int, default=4096, help="KV budget per robot (tokens)")
    ap.add_argument("--geometry", choices=("1.5b", "0.5b"), default="1.5b")
    ap.add_argument("--decode-tokens", type=int, default=8)
    ap.add_argument("--json", default="", help="write the figures here")
    ap.add_argument("--profile", type=robot_counts, default=[],
                    help="robot counts whose decode graph is split by kernel family (alone, and the whole graph "
                         "minus the family: bench/gpu_profile.py), e.g. 1,8")
    args = ap.parse_args(argv)
    if args.batches < 2:
        ap.error("--batches must be >= 2")
    from vla_edge_ros.bench.gpu_session import run_on_gpu

    def body(cuda) -> int:
        import torch
        return _main(args, torch, cuda)
    return run_on_gpu("gpu_fleet_bench", body)


def _main(args, torch, cuda) -> int:
    from vla_edge_ros.core.kv.manager import KVManager
    from vla_edge_ros.engine.cuda import CudaEngine
    from vla_edge_ros.engine.cuda.fleet import FleetCudaEngine
    cfg = ModelConfig.from_json(qwen2_5_1_5b_dict() if args.geometry == "1.5b" else qwen2_5_0_5b_dict())
    tpf, prefix = cfg.n_patches, len(INSTRUCTION.encode())
    bw = copy_bandwidth()
    tensors = random_weights(torch, cfg)
    weights = {k: v.view(torch.int16).cpu().numpy().view(np.uint16) for k, v in tensors.items()}
    del tensors
    torch.cuda.empty_cache()
    rng = np.random.default_rng(0)
    frames = [(0.02 * rng.standard_normal((tpf, cfg.hidden_size))).astype(np.float32) for _ in range(16)]
    kv = lambda name="": KVManager(args.budget, tpf, prefix, policy="fifo", embed_dim=cfg.hidden_size)  # noqa: E731
    out: dict = {"device": cuda.Device(0).name(), "geometry": args.geometry, "budget": args.budget,
                 "copy_bandwidth_Bps": bw, "rows": []}

    # ---- the single-robot engine, same weights, budget and chunk shape
    single = CudaEngine(cfg, weights, kv(), instruction=INSTRUCTION, decode_tokens=args.decode_tokens,
                        max_vram_gb=40.0, log=lambda m: None)
    fid = 0
    while single.kv.occupancy_tokens + tpf <= args.budget:
        single.run_chunk(frames[fid % 16], fid)
        fid += 1
    n_ctx = len(single.kv.context_slots())
    t1 = []
    for _ in range(args.batches):
        r = single.run_chunk(frames[fid % 16], fid)
        fid += 1
        t1.append(r.prefill_ms + r.decode_ms)
    steps = single.decode_steps
    single.close()
    one = pct(t1, 50)
    out["single"] = {"gpu_median_ms": one, "gpu_p99_ms": pct(t1, 99), "n_ctx": n_ctx, "decode_steps": steps}
    print(f"{out['device']}, {args.geometry} geometry, KV budget {args.budget} tokens per robot (context {n_ctx}), "
          f"{1 + steps} passes per chunk, copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    print(f"single-robot CudaEngine: GPU median {one:.3f} ms, p99 {pct(t1, 99):.3f} ms", flush=True)

    # ---- the fleet engine
    M = max(args.robots)
    t0 = time.perf_counter()
    eng = FleetCudaEngine(cfg, weights, kv, instruction=INSTRUCTION, decode_tokens=args.decode_tokens, max_robots=M,
                          budget_tokens=args.budget, max_vram_gb=100.0, log=print)
    del weights
    names = [f"robot{i}" for i in range(M)]
    for name in names:
        eng.add_robot(name)
    print(f"fleet engine ready in {time.perf_counter() - t0:.1f} s; filling {M} caches", flush=True)
    batch = BatchTimer(eng, frames, "gpu_fleet_bench")

    while eng.robot(names[0]).kv.occupancy_tokens + tpf <= args.budget:
        batch(names)
    print(f"\n{'N':>3} {'GPU p50 ms':>11} {'p99':>7} {'prefill':>8} {'decode':>7} {'wall p50':>9} {'per robot':>10} "
          f"{'x single':>9} {'floor ms':>9} {'% floor':>8} {'VRAM GiB':>9}")
    for n in args.robots:
        batch(names[:n])  # the size's graphs are captured here, untimed
        samples = [batch(names[:n]) for _ in range(args.batches)]
        gpu = [t["prefill_ms"] + t["decode_ms"] for _, t in samples]
        med = pct(gpu, 50)
        floor = floor_bytes(cfg, n, n_ctx, steps) / bw * 1e3
        row = {"n": n, "gpu_median_ms": med, "gpu_p99_ms": pct(gpu, 99),
               "prefill_median_ms": pct([t["prefill_ms"] for _, t in samples], 50),
               "decode_median_ms": pct([t["decode_ms"] for _, t in samples], 50),
               "wall_median_ms": pct([w for w, _ in samples], 50),
               "per_robot_ms": med / n, "vs_single": med / one, "floor_ms": floor,
               "vram_gib": eng.memory()["peak_bytes"] / 2**30}
        out["rows"].append(row)
        print(f"{n:>3} {med:>11.3f} {row['gpu_p99_ms']:>7.3f} {row['prefill_median_ms']:>8.3f} "
              f"{row['decode_median_ms']:>7.3f} {row['wall_median_ms']:>9.3f} {med / n:>10.3f} {med / one:>9.2f} "
              f"{floor:>9.3f} {100 * floor / med:>7.1f}% {row['vram_gib']:>9.2f}", flush=True)
    for n in args.profile:  # where a decode step's time goes (the caches are full: steady state)
        from vla_edge_ros.bench import gpu_profile
        eng.enqueue_chunk = lambda k=None, n=n: eng.enqueue_decode(n, k)  # what gpu_profile records and times
        alone, ablate = gpu_profile.time_kernels(eng), gpu_profile.time_ablations(eng)
        out.setdefault("profile", {})[str(n)] = {"alone_ms": alone, "in_chain_ms": ablate}
        print(f"\ndecode graph of {n} robots ({steps} steps): full {ablate['full']:.3f} ms; per family: alone / "
              "in the chain (full minus the graph without it)")
        for fam in sorted(alone, key=lambda f: -alone[f]):
            print(f"  {fam:16s} {alone[fam]:8.3f} {ablate.get(fam, float('nan')):8.3f}")
    mem = eng.memory()
    print(f"\nKV per robot {mem['kv_bytes_per_robot'] / 2**20:.1f} MiB; engine device memory "
          f"{mem['current_bytes'] / 2**30:.2f} GiB for {M} robots")
    eight = [r for r in out["rows"] if r["n"] == 8]
    if eight:
        print(f"goal: 8 robots <= 1.5x the single-robot chunk: {eight[0]['vs_single']:.2f}x "
              f"({'met' if eight[0]['vs_single'] <= 1.5 else 'missed'})")
    eng.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
