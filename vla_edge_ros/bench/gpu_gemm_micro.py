"""The many-row GEMMs alone, no engine (issue 24's fleet prefill, issue 22's parallel pass): gemm32t_atomic over
32-row tiles (tuning ``tiles32``) against gemm_tiled* (``tiled``), for the 1.5B layer's four linear layers and a
few row counts, each on the grid the engines launch it with (built as the engine builds the kernels:
``compiled_kernels``).

    python -m vla_edge_ros.bench.gpu_gemm_micro [--rows 64,96,128,256] [--reps 30] [--json out.json]
        [--tune '{"gemm_min_ks": 128, "gemm_target_blocks": 528}']
    VLA_CUDA_DEFINES="GT_BK=32 GT_STAGES=4" python -m vla_edge_ros.bench.gpu_gemm_micro   # a measuring build (K step)

Why: a whole pass mixes these GEMMs with attention, norms and launches; its time says whether the many-row GEMM
got faster, not which shape holds it back (session 33: the tiled kernel reads weights at about a third of the copy
bandwidth in a pass, and the qkv / o grids have fewer blocks than SMs). Per launch: the median of ``--reps`` graph
replays of back-to-back launches cycling through copies of the weights four times the L2 in all (each launch
reads its weights from DRAM, as in a pass), in us and in GB/s of weights; every launch is checked against numpy
on the same bf16 inputs first (max |error| / max |reference| < 1e-2, else exit status 1). The gate/up GEMM is the
fleet's: gemm32t into fp32 rows (the SiLU pass after it not timed) against the tiled kernel writing silu(gate) * up.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

SHAPES = (("qkv", 2048, 1536), ("o", 1536, 1536), ("gate/up", 17920, 1536), ("down", 1536, 8960))  # 1.5B layer
VARIANTS = ("tiles32", "tiled")
MAX_ERR = 1e-2


def row_counts(text: str) -> list[int]:
    """--rows: comma-separated pass rows, each a multiple of 32 past one tile (one tile is the single engine's)."""
    try:
        rows = [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rows takes comma-separated integers, got {text!r}") from None
    bad = [r for r in rows if r <= 32 or r % 32]
    if not rows or bad:
        raise argparse.ArgumentTypeError(f"--rows: multiples of 32 above 32 (2 tiles or more), got {text!r}")
    return rows


def launch_for(limits, variant: str, N: int, K: int, rows: int, silu: bool, tune: dict | None = None):
    """The launch the fleet makes for this GEMM under tuning fleet_gemm = ``variant`` and the other Tuning fields in
    ``tune`` (fleet_forward.linear; the tiled gate/up: plan.tiled_gemm's SiLU form, as fleet_forward.batched_pass)."""
    import types

    from vla_edge_ros.engine.cuda import fleet_forward
    from vla_edge_ros.engine.cuda.plan import Tuning, tiled_gemm
    t = Tuning.from_mapping({**(tune or {}), "fleet_gemm": variant})
    if variant == "tiled" and silu:
        return tiled_gemm(limits.constants, t, N, K, rows, silu=True)
    return fleet_forward.linear(types.SimpleNamespace(limits=limits, tuning=t), N, K, rows)


def max_rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    """max |out - ref| / max |ref|; inf where out holds a NaN / Inf."""
    out = np.asarray(out, np.float64)
    if not np.all(np.isfinite(out)):
        return math.inf
    return float(np.max(np.abs(out - ref)) / max(float(np.max(np.abs(ref))), 1e-30))


def micro_row(label: str, N: int, K: int, rows: int, variant: str, launch, us: float, err: float) -> dict:
    """One timed launch of a micro-benchmark (its JSON row): GB/s of bf16 weights read."""
    return {"gemm": label, "N": N, "K": K, "rows": rows, "variant": variant, "kernel": launch.kernel,
            "grid": list(launch.grid), "ks": launch.ks, "us": us, "GBps": 2 * N * K / us / 1e3, "max_rel_err": err}


def print_per_layer(rows_out: list[dict], row_counts_: list[int], variants: tuple[str, ...]) -> None:
    """The four GEMMs of a layer summed per row count, each variant beside the first, and the first's speed-up."""
    a, b = variants
    print(f"\nper layer (qkv + o + gate/up + down), us\n{'rows':>4s} {a:>9s} {b:>9s} {'speed-up':>9s}")
    for rows in row_counts_:
        per = {v: sum(r["us"] for r in rows_out if r["rows"] == rows and r["variant"] == v) for v in variants}
        print(f"{rows:4d} {per[a]:9.2f} {per[b]:9.2f} {per[a] / per[b]:8.2f}x")


def finish(out: dict, row_counts_: list[int], variants: tuple[str, ...], failed: int, max_err: float,
           json_path: str) -> int:
    """A micro-benchmark's end: the per-layer table of out["rows"], the checks' verdict, the JSON; exit status 1
    if any check failed."""
    print_per_layer(out["rows"], row_counts_, variants)
    print(f"\n{'all checks passed' if not failed else f'{failed} checks FAILED'} (max |err| / max |ref| < {max_err})")
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(out, fh, indent=1)
    return 1 if failed else 0


def replay_us(cuda, stream, call, weights: list, reps: int, name: str) -> float:
    """Median us per launch of ``call(w)`` over ``reps`` graph replays (after 3 warm-up ones), each replay the
    launches back to back over every copy in ``weights`` (at least 8 launches), so each launch reads its weights
    from DRAM when the copies add up to more than the L2. Shared with gpu_fleet_bench's --gemv-micro."""
    from vla_edge_ros.engine.cuda.graphs import CudaGraph
    copies = len(weights)
    inner = max(copies, 8)

    def enqueue() -> int:
        for i in range(inner):
            call(weights[i % copies])
        return inner
    ev0, ev1 = cuda.Event(), cuda.Event()
    graph = CudaGraph(f"micro-{name}").capture(stream, enqueue)
    try:
        for _ in range(3):
            graph.launch(stream)
        times = []
        for _ in range(reps):
            ev0.record(stream)
            graph.launch(stream)
            ev1.record(stream)
            ev1.synchronize()
            times.append(ev1.time_since(ev0) * 1e3 / inner)
    finally:
        graph.destroy()
    return float(np.median(times))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=row_counts, default=[64, 96, 128, 256])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default="")
    ap.add_argument("--tune", type=json.loads, default={},
                    help='other Tuning fields for both variants, e.g. \'{"gemm_min_ks": 128}\' (the K splits)')
    args = ap.parse_args(argv)
    from vla_edge_ros.bench.gpu_session import run_on_gpu
    from vla_edge_ros.engine.cuda.plan import Tuning
    Tuning.from_mapping(args.tune)  # an unknown field or value is refused here, by name, before the GPU
    return run_on_gpu("gpu_gemm_micro", lambda cuda: run(cuda, args.rows, args.reps, args.json, args.tune))


def compiled_kernels(cuda):
    """(kernels.CompiledKernels, DeviceLimits): every kernel file built as the engine builds it ($VLA_CUDA_ARCH,
    $VLA_CUDA_DEFINES' measuring knobs), and the device's limits with the modules' launch constants. Shared with
    gpu_fleet_bench's --gemv-micro."""
    from vla_edge_ros.engine.cuda.arch import plan_arch
    from vla_edge_ros.engine.cuda.kernels import CompiledKernels
    from vla_edge_ros.engine.cuda.plan import DeviceLimits
    dev, attr = cuda.Device(0), cuda.device_attribute
    arch = plan_arch(dev.compute_capability(), os.environ.get("VLA_CUDA_ARCH", ""))
    kernels = CompiledKernels(cuda, arch.nvcc_arch, arch.target, os.environ.get("VLA_CUDA_DEFINES", "").split())
    limits = DeviceLimits(dev.get_attribute(attr.MULTIPROCESSOR_COUNT),
                          dev.get_attribute(attr.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN), False,
                          constants=kernels.constants())
    return kernels, limits


def run(cuda, row_list: list[int], reps: int, json_path: str = "", tune: dict | None = None) -> int:
    from vla_edge_ros.engine.cuda.buffers import bf16_bits_to_f32, f32_to_bf16_bits
    dev, attr = cuda.Device(0), cuda.device_attribute
    defines = ["-D" + d for d in os.environ.get("VLA_CUDA_DEFINES", "").split()]
    kernels, limits = compiled_kernels(cuda)

    def fn(name: str, smem: int):
        if smem > 48 * 1024:
            kernels.raise_dynamic_smem(name, smem)
        return kernels.fn[name]
    l2 = dev.get_attribute(attr.L2_CACHE_SIZE)
    stream = cuda.Stream()
    rng = np.random.default_rng(0)
    R = max(row_list)
    out: dict = {"device": dev.name(), "defines": defines, "tune": tune or {}, "l2_bytes": l2, "reps": reps,
                 "rows": []}
    print(f"== many-row GEMMs: {dev.name()}, 1.5B layer{' (' + ' '.join(defines) + ')' if defines else ''}; per "
          f"launch: median of {reps} graph replays over weight copies of 4x the L2 ==")
    print(f"{'GEMM':8s} {'rows':>4s} | {'kernel':21s} {'grid':>10s} {'us':>8s} {'GB/s':>7s} {'error':>8s}")
    failed = 0
    for label, N, K in SHAPES:
        silu = label == "gate/up"
        wbytes = 2 * N * K
        copies = max(2, math.ceil(4 * l2 / wbytes))
        w_b = f32_to_bf16_bits(0.05 * rng.standard_normal((N, K)).astype(np.float32))
        a_b = f32_to_bf16_bits(rng.standard_normal((R + 32, K)).astype(np.float32))
        ref = bf16_bits_to_f32(a_b[:R]).astype(np.float64) @ bf16_bits_to_f32(w_b).astype(np.float64).T
        W = [cuda.mem_alloc(wbytes) for _ in range(copies)]
        for buf in W:
            cuda.memcpy_htod(buf, w_b)
        A, C = cuda.to_device(a_b), cuda.mem_alloc(4 * (R + 32) * N)
        try:
            for rows in row_list:
                for v in VARIANTS:
                    launch = launch_for(limits, v, N, K, rows, silu, tune)
                    f, tiles = fn(launch.kernel, launch.smem), np.int32(rows // 32)
                    sil = launch.kernel.endswith("_silu")

                    def call(w) -> None:
                        tail = ((C, tiles) if sil else (np.int32(launch.ks), C, np.int32(N), tiles))
                        f.prepared_async_call(launch.grid, launch.block, stream, A, np.int32(K), w, np.int32(N),
                                              np.int32(K), *tail, shared_size=launch.smem)
                    cuda.memset_d32_async(C, 0, (R + 32) * N, stream)
                    call(W[0])
                    stream.synchronize()
                    if sil:  # act[rows][N / 2] bf16: silu(gate) * up of the interleaved 8-row groups
                        act = np.empty((rows, N // 2), np.uint16)
                        cuda.memcpy_dtoh(act, C)
                        g = ref[:rows].reshape(rows, -1, 2, 8)
                        want = (g[:, :, 0] / (1 + np.exp(-g[:, :, 0])) * g[:, :, 1]).reshape(rows, -1)
                        err = max_rel_err(bf16_bits_to_f32(act), want)
                    else:
                        got = np.empty((rows, N), np.float32)
                        cuda.memcpy_dtoh(got, C)
                        err = max_rel_err(got, ref[:rows])
                    failed += not err < MAX_ERR
                    us = replay_us(cuda, stream, call, W, reps, launch.kernel)
                    row = micro_row(label, N, K, rows, v, launch, us, err)
                    out["rows"].append(row)
                    grid = "x".join(map(str, launch.grid))
                    print(f"{label:8s} {rows:4d} | {launch.kernel:21s} {grid:>10s} {us:8.2f} {row['GBps']:7.0f} "
                          f"{err:8.1e}{'' if err < MAX_ERR else '  FAILED'}", flush=True)
        finally:
            for buf in W + [A, C]:
                buf.free()
    return finish(out, row_list, VARIANTS, failed, MAX_ERR, json_path)


if __name__ == "__main__":
    sys.exit(main())
