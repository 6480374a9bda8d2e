"""Warm-up of the fleet's batched engine: every batch size measured before the loop starts (FleetLoop.warmup).

Why every size: the scheduler extrapolates a size it never measured conservatively (above the largest measured
size L, L's cost times m / L), and refuses sizes that look too expensive, so they would never be measured:
without warm-up the fleet batches less than it could. ``n`` batches of every size 1..max_batch run on synthetic
robots (``WARMUP_PREFIX`` names, reserved) and a seeded synthetic image, and their costs are recorded in the
scheduler in the cost model's three parts; the first batch of each size is left out when n >= 2 (one-off
allocation / graph capture). Warm-up frames count down from -1, one id per frame: a robot's KV cache keeps its
frames across sizes and refuses an id it already holds.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from vla_edge_ros.core.fleet_contract import BatchRequest, FleetEngine
from vla_edge_ros.core.fleet_scheduler import FleetScheduler

WARMUP_PREFIX = "__warmup"  # names of warm-up's synthetic robots (reserved: FleetLoop.add_robot refuses them)


def warm_up(engine: FleetEngine, scheduler: FleetScheduler, n: int, image_shape: tuple[int, int, int],
            clock_ns: Callable[[], int], engine_timing: Callable[[float], tuple[float, float]],
            emit: Callable[[Optional[str], str, dict], None]) -> dict[str, Any]:
    """Run the warm-up (module docstring); returns ``{"batches_per_size": n, "by_batch_size": {m: figures}}``.
    ``engine_timing(wall_ms)``: the pass's (prefill_ms, decode_ms) as the loop reads them from the engine;
    ``emit``: the loop's event callback (a synthetic robot that cannot be removed is reported, not raised)."""
    image = np.random.default_rng(0).integers(0, 256, size=image_shape, dtype=np.uint8)
    names = [f"{WARMUP_PREFIX}{i}" for i in range(scheduler.max_batch)]
    added, figures = [], {}
    try:
        for name in names:
            engine.add_robot(name)
            added.append(name)
        frame_id = 0
        for m in range(1, len(names) + 1):
            passes = []
            for _ in range(n):
                t0 = clock_ns()
                frame_id -= 1
                requests = {k: BatchRequest(engine.encode_frame(image), frame_id, False) for k in names[:m]}
                results = engine.run_batch(requests)
                wall_ms = (clock_ns() - t0) / 1e6
                failed = {k: repr(results.get(k)) for k in requests
                          if results.get(k) is None or isinstance(results.get(k), BaseException)}
                if failed:
                    raise RuntimeError(f"warm-up batch of {m} failed: {failed}")
                prefill_ms, decode_ms = engine_timing(wall_ms)
                passes.append((prefill_ms, decode_ms, wall_ms - prefill_ms - decode_ms))
            for prefill_ms, decode_ms, host_ms in passes[1:] if n >= 2 else passes:
                scheduler.record(m, prefill_ms, decode_ms, engine.decode_steps, host_ms)
            figures[str(m)] = {"pass_ms": [sum(p) for p in passes],
                               "estimate_ms": scheduler.cost_model.estimate_ms(m, engine.decode_steps)}
    finally:
        for name in added:
            try:
                engine.remove_robot(name)
            except Exception as exc:
                emit(name, "robot_remove_failed", {"error": f"{type(exc).__name__}: {exc}"})
    return {"batches_per_size": n, "by_batch_size": figures}
