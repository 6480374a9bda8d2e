"""PDL hop benchmark: the GPU time of one kernel boundary in a chain of dependent kernels, and nothing else.

The layered decode is a chain of six dependent kernels per layer (28 layers x 8 tokens = 1344 boundaries per
chunk). This times chains of ``--hops`` kernels from cuda/bench_hop.cu that do no work but what the dependency
needs, captured in one CUDA graph as the engine's are, with programmatic dependent launch (the engine's mode) and
without, for a few grid sizes:

* ``hop_copy``: out[i] = in[i] + 1 (one value of the predecessor per thread);
* ``hop_vector``: every block reads the whole 1536-float input, block-reduces it, writes its slice (the shape of
  a decode GEMV's prologue and epilogue without the weights).

Printed: us per hop for each, and what 6 hops per layer cost over a chunk's 1344 boundaries. Validation: after the
timed replays the hop_copy chain's last buffer holds the number of hops it added (every hop ran, in order).

Usage (on the GPU machine):
    python -m vla_edge_ros.bench.pdl_hop_bench [--hops 224] [--reps 50] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np

VECTOR = 1536  # hop_vector's input length (the 1.5B model's hidden size)
BOUNDARIES_PER_CHUNK = 6 * 28 * 8  # six kernels per layer, 28 layers, 8 decode tokens


def copy_expected(start: float, hops: int, replays: int) -> tuple[int, float]:
    """hop_copy chains alternate two buffers: hop k reads buf[k % 2] and writes buf[(k + 1) % 2] = that + 1. With an
    even hop count the last hop of a replay writes buf[0] (A), and the next replay goes on from there, so after
    ``replays`` replays starting from A = B = start, A holds start + hops * replays. Returns (0, that value)."""
    if hops % 2:
        raise ValueError("hops must be even (the graph alternates two buffers)")
    return 0, start + hops * replays


def report(rows: list[dict]) -> list[str]:
    """Table lines: kernel, grid, launch mode, us per hop, and the chunk's 1344 boundaries at that cost."""
    out = [f"{'kernel':12s} {'blocks':>6s} {'launch':>6s} {'us/hop':>8s} {'x 1344 (ms)':>12s}"]
    for r in rows:
        out.append(f"{r['kernel']:12s} {r['blocks']:6d} {'PDL' if r['pdl'] else 'plain':>6s} {r['us_per_hop']:8.2f} "
                   f"{r['us_per_hop'] * BOUNDARIES_PER_CHUNK / 1e3:12.2f}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hops", type=int, default=224)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--blocks", default="6,132,264,1120")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    if args.hops < 2 or args.hops % 2:
        ap.error("--hops must be an even number >= 2 (the chain alternates two buffers)")
    from vla_edge_ros.bench.gpu_session import run_on_gpu
    return run_on_gpu("pdl_hop_bench", lambda cuda: _run(args, cuda))


def _run(args, cuda) -> int:
    from pycuda.compiler import compile as nvcc_compile

    from vla_edge_ros.engine.cuda.graphs import CudaGraph, PdlLauncher
    from vla_edge_ros.engine.cuda.kernels import BENCH_KERNELS
    from vla_edge_ros.engine.cuda.probe import CUDA_DIR
    launcher = None
    try:
        cubin = nvcc_compile((CUDA_DIR / "bench_hop.cu").read_text(encoding="utf-8"), no_extern_c=True,
                             include_dirs=[str(CUDA_DIR)], options=["-O3", "-std=c++17"])
        launcher = PdlLauncher()
        mod = launcher.load(cubin)
        fns = {k.name: launcher.function(mod, k.name, k.sig) for k in BENCH_KERNELS}
        stream = cuda.Stream()
        ev0, ev1 = cuda.Event(), cuda.Event()
        rows = []
        for kernel in ("hop_copy", "hop_vector"):
            for blocks in [int(b) for b in args.blocks.split(",") if b.strip()]:
                n = blocks * 256 if kernel == "hop_copy" else VECTOR
                bufs = [cuda.to_device(np.zeros(n, np.float32)) for _ in range(2)]
                for pdl in (True, False):
                    for b in bufs:
                        cuda.memset_d32(b, 0, n)

                    def enqueue() -> int:
                        for k in range(args.hops):
                            fns[kernel].launch((blocks, 1), (256, 1, 1), stream.handle,
                                               (int(bufs[k % 2]), int(bufs[(k + 1) % 2]), n), pdl=pdl and k > 0)
                        return args.hops

                    g = CudaGraph(f"{kernel}-{blocks}-{pdl}").capture(stream, enqueue)
                    try:
                        g.launch(stream)  # warm-up replay
                        ev0.record(stream)
                        for _ in range(args.reps):
                            g.launch(stream)
                        ev1.record(stream)
                        ev1.synchronize()
                        ms = ev1.time_since(ev0) / args.reps
                    finally:
                        g.destroy()
                    row = {"kernel": kernel, "blocks": blocks, "pdl": pdl, "us_per_hop": 1e3 * ms / args.hops}
                    if kernel == "hop_copy":
                        idx, want = copy_expected(0.0, args.hops, args.reps + 1)
                        got = cuda.from_device(bufs[idx], (n,), np.float32)
                        if not np.all(got == want):
                            raise RuntimeError(f"{kernel} x {blocks} (pdl {pdl}): chain result {got[:4]} != {want}")
                    else:
                        got = cuda.from_device(bufs[0], (n,), np.float32)
                        if not np.all(np.isfinite(got)) or not math.isclose(float(got[0]), 0.0, abs_tol=1e-3):
                            raise RuntimeError(f"{kernel} x {blocks} (pdl {pdl}): chain result {got[:4]}")
                    rows.append(row)
        print(f"== pdl_hop_bench: {cuda.Device(0).name()}, {args.hops} hops per graph, {args.reps} replays ==")
        for line in report(rows):
            print(line)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"device": cuda.Device(0).name(), "hops": args.hops, "rows": rows}, f, indent=1)
        return 0
    finally:
        if launcher is not None:
            launcher.unload()


if __name__ == "__main__":
    sys.exit(main())
