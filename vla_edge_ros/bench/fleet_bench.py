"""What batching buys one edge engine serving N robots (issue 24): batched chunk time against N, numpy backend.

    python -m vla_edge_ros.bench.fleet_bench [--robots 1,2,4,8] [--batches 20] [--checkpoint DIR]

Why: a chunk is memory-bound (decode reads every weight once per token), so one pass serving N robots should
cost far less than N passes. Each robot's cache is filled first (budget full, eviction every chunk, as in
steady state); then, per N, ``--batches`` batches of robots 0..N-1 are timed. The table gives the batch's median
wall time (and its prefill / decode split from ``last_batch_timing``), the per-robot time (batch / N) and two
ratios to N = 1: the batch's cost and the per-robot throughput gain. The engine alone, in this process, no ROS.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from vla_edge_ros import params
from vla_edge_ros.core.kv.manager import KVManager
from vla_edge_ros.engine.checkpoint import load_checkpoint
from vla_edge_ros.engine.config import ModelConfig
from vla_edge_ros.engine.factory import resolve_checkpoint
from vla_edge_ros.engine.fleet_numpy import BatchRequest, FleetNumpyEngine
from vla_edge_ros.engine.geometry import prefix_token_ids


class BatchTimer:
    """``timer(members) -> (wall ms, engine.last_batch_timing)`` of one run_batch over the same frames for any fleet
    engine: every batch gets a new frame id (a robot's KV cache refuses an id it holds), member i of it frame
    (id + i) % len(frames); a failed chunk ends the benchmark with the tool's name and the failures."""

    def __init__(self, engine, frames: list, tool: str):
        self.engine, self.frames, self.tool, self.frame_id = engine, frames, tool, 0

    def __call__(self, members: list[str]) -> tuple[float, dict]:
        n = len(self.frames)
        reqs = {name: BatchRequest(self.frames[(self.frame_id + i) % n], self.frame_id)
                for i, name in enumerate(members)}
        self.frame_id += 1
        t0 = time.perf_counter()
        results = self.engine.run_batch(reqs)
        wall_ms = (time.perf_counter() - t0) * 1e3
        failed = {k: v for k, v in results.items() if isinstance(v, Exception)}
        if failed:
            raise SystemExit(f"{self.tool}: chunks failed: {failed}")
        return wall_ms, dict(self.engine.last_batch_timing)


def robot_counts(text: str) -> list[int]:
    try:
        counts = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--robots must be comma-separated integers, got {text!r}") from None
    if not counts or counts[0] < 1:
        raise argparse.ArgumentTypeError(f"--robots needs robot counts >= 1, got {text!r}")
    return counts


def main(argv: list[str] | None = None) -> None:
    """Batched chunk time of the numpy fleet engine for N robots: python -m vla_edge_ros.bench.fleet_bench"""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--robots", type=robot_counts, default=[1, 2, 4, 8], help="robot counts N, e.g. 1,2,4,8")
    ap.add_argument("--batches", type=int, default=20, help="timed batches per N (after the caches are full)")
    ap.add_argument("--checkpoint", default="", help="checkpoint directory (default: the tiny default model)")
    ap.add_argument("--budget", type=int, default=params.KV_BUDGET_BY_BACKEND["numpy"], help="kv_budget_tokens")
    ap.add_argument("--policy", default="fifo", help="eviction policy of every robot")
    ap.add_argument("--decode-tokens", type=int, default=8)
    args = ap.parse_args(argv)
    if args.batches < 1:
        ap.error(f"--batches must be >= 1, got {args.batches}")

    ckpt = resolve_checkpoint(args.checkpoint)
    cfg = ModelConfig.from_json(ckpt)
    instruction = params.BY_NAME["instruction"].default
    tpf, prefix = cfg.n_patches, len(prefix_token_ids(instruction))
    budget = args.budget // tpf * tpf

    def kv_factory() -> KVManager:
        return KVManager(budget, tpf, prefix, policy=args.policy, embed_dim=cfg.hidden_size)

    engine = FleetNumpyEngine(cfg, load_checkpoint(ckpt, cfg), kv_factory, instruction=instruction,
                              decode_tokens=args.decode_tokens)
    names = [f"robot{i}" for i in range(max(args.robots))]
    for name in names:
        engine.add_robot(name)
    rng = np.random.default_rng(0)
    frames = [engine.encode_frame(rng.integers(0, 256, (240, 320, 3), dtype=np.uint8)) for _ in range(16)]
    batch = BatchTimer(engine, frames, "fleet_bench")

    capacity = engine.robot(names[0]).kv.capacity_frames
    for _ in range(capacity + 2):  # fill every cache: the timed chunks attend to a full context and evict
        batch(names)
    print(f"numpy fleet engine, {ckpt.name}, budget {budget} tokens ({capacity} frames), policy {args.policy}, "
          f"decode steps {engine.decode_steps}, {args.batches} batches per N, OPENBLAS_NUM_THREADS="
          f"{os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}, load average {os.getloadavg()[0]:.2f}", flush=True)
    rows = []
    for n in args.robots:
        batch(names[:n])  # one untimed batch of this size
        samples = [batch(names[:n]) for _ in range(args.batches)]
        wall = float(np.median([s[0] for s in samples]))
        prefill = float(np.median([s[1]["prefill_ms"] for s in samples]))
        decode = float(np.median([s[1]["decode_ms"] for s in samples]))
        rows.append((n, wall, prefill, decode))
        print(f"  N={n}: batch p50 {wall:.2f} ms ({wall / n:.2f} ms per robot)", flush=True)
    n1, wall1 = rows[0][0], rows[0][1]  # the smallest N (N = 1 when asked)
    print(f"\n{'N':>3} {'batch p50 ms':>13} {'prefill ms':>11} {'decode ms':>10} {'per robot ms':>13} "
          f"{'batch / N=' + str(n1):>12} {'robots/s gain':>14}")
    for n, wall, prefill, decode in rows:
        print(f"{n:>3} {wall:>13.2f} {prefill:>11.2f} {decode:>10.2f} {wall / n:>13.2f} "
              f"{wall / wall1:>12.2f} {(wall1 / n1) / (wall / n):>14.2f}")
    engine.close()


if __name__ == "__main__":
    main()
