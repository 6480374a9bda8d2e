"""One GPU serving N robots (issue 24): batched chunk time for N = 1, 2, 4, 8, 16 against the single-robot engine,
with each N's bandwidth floor, in one run.

    python -m vla_edge_ros.bench.gpu_fleet_bench [--robots 1,2,4,8,16] [--batches 30] [--budget 4096]
        [--geometry 1.5b|0.5b] [--fleet-gemv rows,mma] [--fleet-gemm tiles32,tiled] [--json out.json]
    python -m vla_edge_ros.bench.gpu_fleet_bench --gemv-micro [--json out.json]

Why: a chunk is memory-bound, so N robots in one pass should cost the weights once plus each robot's K/V, not N
chunks. Random bf16 weights of the Qwen2.5 geometry (no weights can be downloaded; the timing does not depend on
the values). Every robot's cache is filled to the budget first (eviction every chunk, as in steady state), then
``--batches`` batches of robots 0..N-1 are timed per N (GPU events of the two graph replays, and wall time from the
host). The single-robot figure is engine/cuda's CudaEngine on the same weights, budget and chunk shape, timed in
the same run. Floor per N: (1 + S) passes x (the weights once + every member's K/V rows) / the device-to-device
copy bandwidth measured here. Goal (issue 24): 8 robots in <= 1.5x the single-robot chunk time.

``--fleet-gemv rows,mma``: the N sweep once per few-row decode GEMM (tuning.fleet_gemv: gemv_rows_atomic, then
gemv_rows_mma), on the same engine and caches, each with its ratio to the single engine. ``--fleet-gemm
tiles32,tiled``: the same for the prefill's many-row GEMMs (tuning.fleet_gemm: gemm32t_atomic, gemm_tiled*_atomic);
with both options, every pair (variant "mma+tiled").

``--gemv-micro``: the two few-row GEMMs alone, no engine (the kernels built as the engine builds them,
$VLA_CUDA_DEFINES included: gpu_gemm_micro.compiled_kernels): for the 1.5B decode step's four linear layers and
1, 2, 4, 8, 16 rows, each on the grid the fleet launches it with (fleet_forward.linear), the median of 50 graph replays
(after warm-up) of back-to-back launches that cycle through copies of the weights four times the L2 in all (each
launch reads its weights from DRAM, as in a decode pass), in us per launch and GB/s of weights; and each checked
against numpy on the same bf16 inputs (max |error| / max |reference| < 1e-2, else exit status 1).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import types

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


MICRO_SHAPES = (("qkv", 2048, 1536), ("o", 1536, 1536), ("gate/up", 17920, 1536), ("down", 1536, 8960))  # 1.5B
MICRO_ROWS = (1, 2, 4, 8, 16)
MICRO_MAX_ERR = 1e-2  # max |error| / max |reference| of a few-row GEMM against numpy


def _names(text: str, known, option: str) -> list[str]:
    names = list(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    bad = [n for n in names if n not in known]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"{option} takes {', '.join(known)} (comma-separated), got {text!r}")
    return names


def fleet_gemv_variants(text: str) -> list[str]:
    """--fleet-gemv: comma-separated tuning.fleet_gemv values, in the order given, each once."""
    from vla_edge_ros.engine.cuda.fleet_forward import FLEET_GEMV
    return _names(text, FLEET_GEMV, "--fleet-gemv")


def fleet_gemm_variants(text: str) -> list[str]:
    """--fleet-gemm: comma-separated tuning.fleet_gemm values, in the order given, each once."""
    from vla_edge_ros.engine.cuda.plan import MANY_ROW_GEMMS
    return _names(text, MANY_ROW_GEMMS, "--fleet-gemm")


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
    ap.add_argument("--fleet-gemv", type=fleet_gemv_variants, default=None,
                    help="few-row decode GEMMs to time in turn (tuning.fleet_gemv), e.g. rows,mma; default: the "
                         "engine's default")
    ap.add_argument("--fleet-gemm", type=fleet_gemm_variants, default=None,
                    help="many-row prefill GEMMs to time in turn (tuning.fleet_gemm), e.g. tiles32,tiled; default: "
                         "the engine's default")
    ap.add_argument("--gemv-micro", action="store_true",
                    help="time gemv_rows_atomic against gemv_rows_mma alone (1.5B shapes, 1..16 rows) and check "
                         "both against numpy; no engine run")
    args = ap.parse_args(argv)
    if args.batches < 2:
        ap.error("--batches must be >= 2")
    from vla_edge_ros.bench.gpu_session import run_on_gpu

    def body(cuda) -> int:
        if args.gemv_micro:
            return gemv_micro(cuda, args.json)
        import torch
        return _main(args, torch, cuda)
    return run_on_gpu("gpu_fleet_bench", body)


def gemv_micro(cuda, json_path: str = "", reps: int = 50) -> int:
    """gemv_rows_atomic vs gemv_rows_mma alone (module docstring); 1 when either misses MICRO_MAX_ERR."""
    from vla_edge_ros.bench.gpu_gemm_micro import compiled_kernels, finish, max_rel_err, micro_row, replay_us
    from vla_edge_ros.engine.cuda import fleet_forward
    from vla_edge_ros.engine.cuda.buffers import bf16_bits_to_f32, f32_to_bf16_bits
    from vla_edge_ros.engine.cuda.plan import Tuning
    dev = cuda.Device(0)
    attr = cuda.device_attribute
    kernels, limits = compiled_kernels(cuda)
    consts = limits.constants
    engines = {v: types.SimpleNamespace(limits=limits, tuning=Tuning(fleet_gemv=v)) for v in fleet_forward.FLEET_GEMV}
    # as the fleet engine: gemv_rows_atomic's fp32 rows may take more than the default 48 KiB
    kernels.raise_dynamic_smem("gemv_rows_atomic", 4 * consts.GR_MAXM * fleet_forward.GR_MAX_KS)
    l2 = dev.get_attribute(attr.L2_CACHE_SIZE)
    stream = cuda.Stream()
    rng = np.random.default_rng(0)
    out: dict = {"device": dev.name(), "l2_bytes": l2, "reps": reps, "rows": []}
    print(f"== gemv micro: {dev.name()}, 1.5B decode GEMMs; per launch: median of {reps} graph replays of "
          "back-to-back launches over weight copies of 4x the L2; error: max |err| / max |ref| vs numpy ==")
    print(f"{'GEMM':8s} {'N':>6s} {'K':>5s} {'rows':>4s} | {'kernel':17s} {'grid':>9s} {'us':>8s} {'GB/s':>7s} "
          f"{'error':>8s}")
    failed = 0
    for label, N, K in MICRO_SHAPES:
        wbytes = 2 * N * K
        copies = max(2, math.ceil(4 * l2 / wbytes))
        w_b = f32_to_bf16_bits(0.05 * rng.standard_normal((N, K)).astype(np.float32))
        a_b = f32_to_bf16_bits(rng.standard_normal((16, K)).astype(np.float32))
        ref = bf16_bits_to_f32(a_b).astype(np.float64) @ bf16_bits_to_f32(w_b).astype(np.float64).T
        W = [cuda.mem_alloc(wbytes) for _ in range(copies)]
        for buf in W:
            cuda.memcpy_htod(buf, w_b)
        A, C = cuda.to_device(a_b), cuda.mem_alloc(4 * 16 * N)
        try:
            for rows in MICRO_ROWS:
                for v, e in engines.items():
                    launch = fleet_forward.linear(e, N, K, rows)
                    f = kernels.fn[launch.kernel]

                    def run(w) -> None:
                        f.prepared_async_call(launch.grid, launch.block, stream, A, np.int32(K), w, np.int32(N),
                                              np.int32(K), np.int32(launch.ks), C, np.int32(N), np.int32(rows),
                                              shared_size=launch.smem)
                    cuda.memset_d32_async(C, 0, 16 * N, stream)
                    run(W[0])
                    stream.synchronize()
                    c = np.empty((16, N), np.float32)
                    cuda.memcpy_dtoh(c, C)
                    err = max_rel_err(c[:rows], ref[:rows])
                    failed += not err < MICRO_MAX_ERR
                    us = replay_us(cuda, stream, run, W, reps, launch.kernel)
                    row = micro_row(label, N, K, rows, v, launch, us, err)
                    out["rows"].append(row)
                    grid = "x".join(map(str, launch.grid))
                    print(f"{label:8s} {N:6d} {K:5d} {rows:4d} | {launch.kernel:17s} {grid:>9s} {us:8.2f} "
                          f"{row['GBps']:7.0f} {err:8.1e}{'' if err < MICRO_MAX_ERR else '  FAILED'}", flush=True)
        finally:
            for buf in W + [A, C]:
                buf.free()
    return finish(out, list(MICRO_ROWS), ("rows", "mma"), failed, MICRO_MAX_ERR, json_path)


def use_tuning(eng, **changes) -> None:
    """The fleet engine's launches on other tuning values (fleet_gemv, fleet_gemm): its captured graphs dropped, so
    the next batch of each size captures them again with the new launches."""
    with eng._active():
        eng.stream.synchronize()
        for g in eng._graphs.values():
            g.destroy()
        eng._graphs = {}
    eng.tuning = eng.tuning.with_changes(**changes)


def variants(args, tuning) -> list[tuple[str, dict]]:
    """(label, tuning changes) for every pair of --fleet-gemm x --fleet-gemv (each defaulting to the engine's);
    the label is the few-row GEMM's alone when the many-row one was not asked for (the runs before it)."""
    gemms, gemvs = args.fleet_gemm or [tuning.fleet_gemm], args.fleet_gemv or [tuning.fleet_gemv]
    return [(gemv if args.fleet_gemm is None else f"{gemv}+{gemm}", {"fleet_gemv": gemv, "fleet_gemm": gemm})
            for gemm in gemms for gemv in gemvs]


def _main(args, torch, cuda) -> int:
    from vla_edge_ros.core.kv.manager import KVManager
    from vla_edge_ros.engine.cuda import CudaEngine, fleet_forward
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
    out["variants"] = {}
    for variant, changes in variants(args, eng.tuning):
        use_tuning(eng, **changes)
        rows = out["variants"][variant] = []
        print(f"\ndecode GEMMs of <= {eng.limits.constants.GR_MAXM} robots: {changes['fleet_gemv']} "
              f"({fleet_forward.fleet_gemv_kernel(eng.tuning)}); prefill GEMMs: {changes['fleet_gemm']}")
        print(f"{'N':>3} {'GPU p50 ms':>11} {'p99':>7} {'prefill':>8} {'decode':>7} {'wall p50':>9} "
              f"{'per robot':>10} {'x single':>9} {'floor ms':>9} {'% floor':>8} {'VRAM GiB':>9}")
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
            rows.append(row)
            print(f"{n:>3} {med:>11.3f} {row['gpu_p99_ms']:>7.3f} {row['prefill_median_ms']:>8.3f} "
                  f"{row['decode_median_ms']:>7.3f} {row['wall_median_ms']:>9.3f} {med / n:>10.3f} "
                  f"{med / one:>9.2f} {floor:>9.3f} {100 * floor / med:>7.1f}% {row['vram_gib']:>9.2f}", flush=True)
        for n in args.profile:  # where a decode step's time goes (the caches are full: steady state)
            from vla_edge_ros.bench import gpu_profile
            eng.enqueue_chunk = lambda k=None, n=n: eng.enqueue_decode(n, k)  # what gpu_profile records and times
            alone, ablate = gpu_profile.time_kernels(eng), gpu_profile.time_ablations(eng)
            out.setdefault("profile", {}).setdefault(variant, {})[str(n)] = {"alone_ms": alone,
                                                                            "in_chain_ms": ablate}
            print(f"\ndecode graph of {n} robots ({steps} steps, {variant}): full {ablate['full']:.3f} ms; per "
                  "family: alone / in the chain (full minus the graph without it)")
            for fam in sorted(alone, key=lambda f: -alone[f]):
                print(f"  {fam:16s} {alone[fam]:8.3f} {ablate.get(fam, float('nan')):8.3f}")
    out["rows"] = rows  # the last variant's (the key earlier runs wrote)
    mem = eng.memory()
    print(f"\nKV per robot {mem['kv_bytes_per_robot'] / 2**20:.1f} MiB; engine device memory "
          f"{mem['current_bytes'] / 2**30:.2f} GiB for {M} robots")
    for variant, rows in out["variants"].items():
        eight = [r for r in rows if r["n"] == 8]
        if eight:
            print(f"goal: 8 robots <= 1.5x the single-robot chunk ({variant}): {eight[0]['vs_single']:.2f}x "
                  f"({'met' if eight[0]['vs_single'] <= 1.5 else 'missed'})")
    eng.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
