"""GPU benchmark of issue 23: the passes a chunk needs and the bytes a pass reads, side by side in one run.

Rows (Qwen2.5-1.5B geometry by default, random bf16 weights generated on the GPU, a KV cache filled to the
budget, 4096 tokens): the seed chunk shape (1 prefill + 8 decode passes, ``vla.action_start: token``) in bf16, and
the 7-pass shape (1 prefill whose logits give bin 1, then 6 decode passes, ``action_start: prefill``) in each
weight type the CUDA kernels take (bf16; int8 and fp8 e4m3: per-row scales; int4: groups of 128 with zero
points; quantised at load). HF transformers with
StaticCache + torch.compile (bf16) runs the same 7 passes in the same process. Per row: median and p99 GPU time per
chunk, the bandwidth floor (bytes the chunk must read: every linear weight at its stored size plus the bf16 head
rows once per pass, plus the K/V rows of the context, over the device-to-device copy bandwidth measured here), the
fraction of it reached, and peak VRAM. Quality: per pass, the cosine of the int8 engine's action logits against
the bf16 engine's, and how many action tokens agree over the same frames (the bf16 engine itself is checked
against HF in test/test_cuda_model.py).

Usage (GPU machine): python -m vla_edge_ros.bench.gpu_quant_bench [--chunks 200] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from vla_edge_ros.bench.gpu_chunk_bench import INSTRUCTION, copy_bandwidth, pct, random_weights, run_hf
from vla_edge_ros.engine.config import ModelConfig, qwen2_5_0_5b_dict, qwen2_5_1_5b_dict

SHAPES = {"seed": "token", "7-pass": "prefill"}


def chunk_bytes(cfg: ModelConfig, weight_dtype: str, n_ctx: int, passes: int) -> int:
    """Bytes one chunk reads at least: the linear weights at their stored size and the 256 bf16 head rows each
    pass, the context's K/V rows (and the keys the decode passes add) per pass."""
    from vla_edge_ros.engine import quant
    linear = quant.weights_nbytes(quant.linear_shapes(cfg), weight_dtype)
    head = 2 * cfg.n_action_bins * cfg.hidden_size
    kv_per_key = cfg.num_hidden_layers * 2 * 2 * cfg.num_key_value_heads * cfg.head_dim
    return sum(linear + head + kv_per_key * (n_ctx + i) for i in range(passes))


def run_engine(cfg_dict: dict, weights_np: dict, weight_dtype: str, args, frames, log) -> dict:
    from vla_edge_ros.bench import gpu_profile
    from vla_edge_ros.core.kv.manager import KVManager
    from vla_edge_ros.engine.cuda import CudaEngine
    cfg = ModelConfig.from_json(cfg_dict)
    kv = KVManager(args.budget, cfg.n_patches, len(INSTRUCTION.encode()), policy="fifo", embed_dim=cfg.hidden_size)
    t0 = time.perf_counter()
    eng = CudaEngine(cfg, weights_np, kv, instruction=INSTRUCTION, decode_tokens=8, max_vram_gb=args.max_vram_gb,
                     log=log, weight_dtype=weight_dtype, tuning=args.tuning)
    setup_s = time.perf_counter() - t0
    try:
        fid = 0
        while eng.kv.occupancy_tokens + cfg.n_patches <= args.budget:  # fill the cache to the budget
            eng.run_chunk(frames[fid % len(frames)], fid)
            fid += 1
        n_ctx = len(eng.kv.context_slots())
        # the quality frames: the same frames in the same order for every row, the cache full
        logits, tokens = [], []
        for f in frames:
            r = eng.run_chunk(f, fid)
            fid += 1
            logits.append(eng.last_logits.copy())
            tokens.append(np.asarray(r.chunk_bins).ravel().copy())
        gpu, pre, dec = [], [], []
        for i in range(args.chunks):
            r = eng.run_chunk(frames[i % len(frames)] + np.float32(1e-3 * i), fid)
            fid += 1
            gpu.append(r.prefill_ms + r.decode_ms)
            pre.append(r.prefill_ms)
            dec.append(r.decode_ms)
        mem = eng.memory()
        # each kernel family alone, one chunk's launches in one graph (leaves garbage behind: measured last)
        kernel_ms = gpu_profile.time_kernels(eng, reps=10) if args.profile else {}
        passes = 1 + eng.decode_steps
        return {"weight_dtype": weight_dtype, "action_start": cfg.action_start, "passes": passes, "n_ctx": n_ctx,
                "setup_s": setup_s, "gpu_median_ms": pct(gpu, 50), "gpu_p99_ms": pct(gpu, 99), "chunks": len(gpu),
                "prefill_median_ms": pct(pre, 50), "decode_median_ms": pct(dec, 50), "kernel_ms": kernel_ms,
                "peak_vram_bytes": int(mem["peak_bytes"]), "bytes": chunk_bytes(cfg, weight_dtype, n_ctx, passes),
                "_logits": logits, "_tokens": tokens}
    finally:
        eng.close()


def tuning_arg(text: str) -> dict:
    """'a=1,b=2' -> {'a': 1, 'b': 2} (integers where they parse; plan.Tuning validates names and values)."""
    out = {}
    for part in filter(None, (x.strip() for x in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"--tuning wants KEY=VALUE pairs, got {part!r}")
        out[key.strip()] = int(value) if value.strip().lstrip("-").isdigit() else value.strip()
    return out


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--geometry", choices=["1.5b", "0.5b"], default="1.5b")
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--chunks", type=int, default=200)
    ap.add_argument("--hf-chunks", type=int, default=20)
    ap.add_argument("--weight-dtypes", default="bf16,int8,fp8,int4")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--profile", action="store_true", help="time each kernel family alone (bench/gpu_profile.py)")
    ap.add_argument("--max-vram-gb", type=float, default=8.0)
    ap.add_argument("--json", default="")
    ap.add_argument("--tuning", type=tuning_arg, default={},
                    help="plan.Tuning fields for a measured alternative, e.g. gemv_target_blocks=528,gemv_min_ks=256")
    args = ap.parse_args(argv)
    from vla_edge_ros.bench.gpu_session import run_on_gpu

    def body(cuda) -> int:
        import torch
        return _main(args, torch, cuda)
    return run_on_gpu("gpu_quant_bench", body)


def _main(args, torch, cuda) -> int:
    base = qwen2_5_1_5b_dict() if args.geometry == "1.5b" else qwen2_5_0_5b_dict()
    cfg = ModelConfig.from_json(base)
    bw = copy_bandwidth()
    tensors = random_weights(torch, cfg)
    weights_np = {k: v.view(torch.int16).cpu().numpy().view(np.uint16) for k, v in tensors.items()}
    rng = np.random.default_rng(0)
    frames = [(0.02 * rng.standard_normal((cfg.n_patches, cfg.hidden_size))).astype(np.float32) for _ in range(8)]
    rows, logs = [], []
    plan = [("seed", "bf16")] + [("7-pass", wd) for wd in args.weight_dtypes.split(",")]
    for shape, wd in plan:
        d = json.loads(json.dumps(base))
        d.setdefault("vla", {})["action_start"] = SHAPES[shape]  # the Qwen geometries carry no vla block
        print(f"[gpu_quant_bench] {shape} {wd} ...", flush=True)
        try:
            row = run_engine(d, weights_np, wd, args, frames, logs.append)
        except Exception as exc:
            row = {"weight_dtype": wd, "error": f"{type(exc).__name__}: {exc}"}
        row["shape"] = shape
        rows.append(row)
    hf = None
    if not args.no_hf:
        n_ctx = next((r["n_ctx"] for r in rows if "n_ctx" in r), args.budget)
        hf_args = argparse.Namespace(decode_tokens=6, hf_chunks=args.hf_chunks, chunks=args.hf_chunks)
        try:
            hf = run_hf(torch, base, tensors, n_ctx, hf_args, compiled=True)
        except Exception as exc:
            hf = {"error": f"{type(exc).__name__}: {exc}"}
    # quality: each 7-pass row against the 7-pass bf16 row (same frames, same cache)
    ref = next((r for r in rows if r.get("shape") == "7-pass" and r.get("weight_dtype") == "bf16" and "_logits" in r),
               None)
    for r in rows:
        if ref is not None and r is not ref and r.get("shape") == "7-pass" and "_logits" in r:
            per_pass = [min(cosine(a[i], b[i]) for a, b in zip(r["_logits"], ref["_logits"]))
                        for i in range(ref["_logits"][0].shape[0])]
            agree = np.mean([np.mean(a == b) for a, b in zip(r["_tokens"], ref["_tokens"])])
            r["vs_bf16"] = {"logits_cosine_min_per_pass": per_pass, "action_token_agreement": float(agree)}
    for r in rows:
        r.pop("_logits", None)
        r.pop("_tokens", None)
        if "bytes" in r:
            r["floor_ms"] = r["bytes"] / bw * 1e3
            r["floor_fraction"] = r["floor_ms"] / r["gpu_median_ms"]
    hf_ms = (hf or {}).get("median_ms") or (hf or {}).get("gpu_median_ms")
    print(f"\ncopy bandwidth {bw / 1e12:.2f} TB/s; {args.geometry} geometry, budget {args.budget} tokens")
    print("| shape | weights | passes | median ms | p99 ms | floor ms | of floor | peak VRAM GiB | vs HF compiled |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['shape']} | {r['weight_dtype']} | FAILED: {r['error']} |")
            continue
        x = f"{hf_ms / r['gpu_median_ms']:.2f}x" if hf_ms else "-"
        print(f"| {r['shape']} | {r['weight_dtype']} | {r['passes']} | {r['gpu_median_ms']:.3f} | {r['gpu_p99_ms']:.3f} "
              f"| {r['floor_ms']:.3f} | {100 * r['floor_fraction']:.0f} % | {r['peak_vram_bytes'] / 2**30:.3f} | {x} |")
    ok = [r for r in rows if "error" not in r]
    print("\nprefill / decode pass medians (ms): " + "; ".join(
        f"{r['shape']} {r['weight_dtype']} {r['prefill_median_ms']:.3f} / {r['decode_median_ms']:.3f}" for r in ok))
    fams = list(dict.fromkeys(f for r in ok for f in r["kernel_ms"]))
    if fams:
        print("| kernel family alone, ms per chunk | " + " | ".join(f"{r['shape']} {r['weight_dtype']}" for r in ok)
              + " |\n|---|" + "---|" * len(ok))
        for f in fams:
            print(f"| {f} | " + " | ".join(f"{r['kernel_ms'].get(f, float('nan')):.3f}" for r in ok) + " |")
    if hf is not None:
        print(f"HF StaticCache + torch.compile, bf16, 7 passes: {json.dumps(hf)}")
    for r in rows:
        if "vs_bf16" in r:
            v = r["vs_bf16"]
            print(f"{r['weight_dtype']} vs bf16 (7-pass): action-token agreement {100 * v['action_token_agreement']:.1f} "
                  f"%, min logits cosine per pass {', '.join(f'{c:.5f}' for c in v['logits_cosine_min_per_pass'])}")
    for line in logs[-6:]:
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bandwidth_Bps": bw, "rows": rows, "hf_compiled_7pass": hf}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
