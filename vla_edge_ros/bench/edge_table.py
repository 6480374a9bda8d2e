"""Which model and weight type fit a 33 ms cycle on an edge GPU (issue 23): a prediction from measured bytes.

Batch-1 decoding reads every linear weight once per pass, so a chunk's time on another GPU follows from the bytes
it reads (bench/gpu_quant_bench.chunk_bytes: the weights at their stored size, the head rows and the context's
K/V, per pass) and the GPU's memory bandwidth. Two figures per row: the bandwidth floor (every byte at the GPU's
full bandwidth: no GPU does better) and the expected time, the floor divided by the fraction of its floor the same
weight type reached on the H200 (gpu_quant_bench's JSON, ``--measured``): the kernels' efficiency carried over. That
is pessimistic where a kernel misses the H200's bandwidth for want of issue slots (the quantised GEMVs): on a GPU
with a twentieth of the bandwidth the same kernel gets nearer its floor. The truth lies between the two columns.
A row fits when its time is within ``deadline_ms - safety_margin_ms`` and the device memory (weights + KV budget +
scratch, engine/cuda/vram.py's count) within the GPU's memory; both verdicts are printed (at the floor, expected).

Usage (no GPU needed):
    python -m vla_edge_ros.bench.edge_table --measured results/quant_1p5b.json [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from vla_edge_ros.engine.config import ModelConfig, qwen2_5_0_5b_dict, qwen2_5_1_5b_dict

GIB = 2 ** 30
# name -> (memory bandwidth B/s, device memory bytes): public specifications
GPUS = {"Jetson Orin class (205 GB/s, 8 GB)": (205e9, 8 * GIB),
        "RTX 4090 class (1 TB/s, 24 GB)": (1.0e12, 24 * GIB)}
GEOMETRIES = {"0.5b": qwen2_5_0_5b_dict, "1.5b": qwen2_5_1_5b_dict}
WEIGHT_DTYPES = ("bf16", "int8", "fp8", "int4")
PASSES = 7  # the 7-pass chunk (vla.action_start "prefill"): 1 prefill + 6 decode passes


def device_bytes(cfg: ModelConfig, weight_dtype: str, budget: int) -> int:
    """What the CUDA engine's VRAM check counts: weights at their stored size, the KV budget, scratch."""
    from vla_edge_ros.engine.cuda.plan import padded_intermediate
    from vla_edge_ros.engine.cuda.vram import memory_plan, quantized_model_bytes
    sizes = memory_plan(cfg, budget, PASSES + 1)
    return int(quantized_model_bytes(sizes["model"], cfg, weight_dtype, padded_intermediate(cfg))
               + sizes["kv"] + sizes["scratch"])


def efficiencies(measured: Optional[dict]) -> dict[str, float]:
    """Fraction of its bandwidth floor each weight type's 7-pass chunk reached (gpu_quant_bench rows)."""
    out = {}
    for r in (measured or {}).get("rows", []):
        if r.get("shape") == "7-pass" and "floor_fraction" in r:
            out[r["weight_dtype"]] = float(r["floor_fraction"])
    return out


def rows(measured: Optional[dict], budget: int = 4096, deadline_ms: float = 33.0,
         safety_margin_ms: float = 2.0) -> list[dict[str, Any]]:
    from vla_edge_ros.bench.gpu_quant_bench import chunk_bytes
    eff = efficiencies(measured)
    # the context the measured run read (its full cache: whole frames after the pinned prefix, 4082 of 4096), or
    # the same margin below a budget without a measured run
    n_ctx = next((int(r["n_ctx"]) for r in (measured or {}).get("rows", []) if "n_ctx" in r), budget - 14)
    out = []
    for geometry, make in GEOMETRIES.items():
        cfg = ModelConfig.from_json(make())
        for wd in WEIGHT_DTYPES:
            nbytes, vram = chunk_bytes(cfg, wd, n_ctx, PASSES), device_bytes(cfg, wd, budget)
            for gpu, (bw, mem) in GPUS.items():
                floor_ms = nbytes / bw * 1e3
                expected_ms = floor_ms / eff[wd] if wd in eff else None
                budget_ms = deadline_ms - safety_margin_ms
                fits_time = expected_ms is not None and expected_ms <= budget_ms
                out.append({"geometry": geometry, "weight_dtype": wd, "gpu": gpu, "bytes_per_chunk": nbytes,
                            "floor_ms": floor_ms, "h200_fraction": eff.get(wd), "expected_ms": expected_ms,
                            "device_bytes": vram, "fits_memory": vram <= mem,
                            "fits_at_floor": bool(floor_ms <= budget_ms and vram <= mem),
                            "fits": bool(fits_time and vram <= mem)})
    return out


def table(rs: list[dict[str, Any]], deadline_ms: float = 33.0, safety_margin_ms: float = 2.0) -> str:
    lines = [f"| model | weights | GPU | GB per chunk | floor ms | H200 fraction | expected ms | device GiB | fits "
             f"{deadline_ms:g} - {safety_margin_ms:g} ms: at the floor / expected |", "|" + "---|" * 9]
    for r in rs:
        exp = f"{r['expected_ms']:.1f}" if r["expected_ms"] is not None else "-"
        frac = f"{100 * r['h200_fraction']:.0f} %" if r["h200_fraction"] is not None else "-"
        yn = (lambda ok: "yes" if ok else ("no (memory)" if not r["fits_memory"] else "no"))
        why = f"{yn(r['fits_at_floor'])} / {yn(r['fits'])}"
        lines.append(f"| {r['geometry']} | {r['weight_dtype']} | {r['gpu']} | {r['bytes_per_chunk'] / 1e9:.2f} "
                     f"| {r['floor_ms']:.1f} | {frac} | {exp} | {r['device_bytes'] / GIB:.2f} | {why} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measured", default="", help="gpu_quant_bench --json output (the H200's fractions of floor)")
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--deadline-ms", type=float, default=33.0)
    ap.add_argument("--safety-margin-ms", type=float, default=2.0)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    measured = json.loads(Path(args.measured).read_text()) if args.measured else None
    if measured is None:
        print("edge_table: no --measured JSON: floors only (no expected times, nothing marked as fitting)")
    rs = rows(measured, args.budget, args.deadline_ms, args.safety_margin_ms)
    print(table(rs, args.deadline_ms, args.safety_margin_ms))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
