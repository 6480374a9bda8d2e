"""The numpy engine's chunk time at a full KV cache (tiny default), split into prefill / decode, wall and CPU.

    python -m vla_edge_ros.bench.numpy_chunk_bench [--budget 512] [--policy fifo] [--chunks 200]

The engine alone, in this process, without ROS: what the admission controller's estimate is made of on a CPU.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from vla_edge_ros.engine.factory import make_engine
def main(argv: list[str] | None = None) -> None:
    """Chunk timing of the tiny default at a full KV cache: python -m vla_edge_ros.bench.numpy_chunk_bench"""

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--budget", type=int, default=512, help="kv_budget_tokens (the numpy default: 512)")
    ap.add_argument("--policy", default="fifo")
    ap.add_argument("--chunks", type=int, default=200, help="measured chunks (after the cache is full)")
    ap.add_argument("--no-speculative", action="store_true")
    args = ap.parse_args(argv)
    eng = make_engine({"backend": "numpy", "kv_budget_tokens": args.budget, "eviction_policy": args.policy},
                      log=lambda m: None)
    eng.speculative = not args.no_speculative
    rng = np.random.default_rng(0)
    frames = [eng.encode_frame(rng.integers(0, 256, (240, 320, 3), dtype=np.uint8)) for _ in range(16)]
    fill = eng.kv.capacity_frames + 2
    for f in range(fill):
        eng.run_chunk(frames[f % 16], f)
    rows = []
    for f in range(fill, fill + args.chunks):
        c0 = time.process_time()
        r = eng.run_chunk(frames[f % 16], f)
        rows.append((r.total_ms, r.prefill_ms, r.decode_ms, (time.process_time() - c0) * 1e3, eng.last_decode_passes))
    a = np.array(rows)
    print(f"numpy engine, tiny default, budget {args.budget} tokens (occupancy {eng.kv.occupancy_tokens}), "
          f"policy {args.policy}, speculative {eng.speculative}, OPENBLAS_NUM_THREADS="
          f"{os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}, load average {os.getloadavg()[0]:.2f}")
    for i, name in enumerate(("wall total", "wall prefill", "wall decode", "cpu total")):
        print(f"  {name:12s} ms: p50 {np.percentile(a[:, i], 50):6.2f}  p90 {np.percentile(a[:, i], 90):6.2f}  "
              f"p99 {np.percentile(a[:, i], 99):6.2f}  max {a[:, i].max():6.2f}")
    print(f"  decode passes per chunk: mean {a[:, 4].mean():.2f}")


if __name__ == "__main__":
    main()
