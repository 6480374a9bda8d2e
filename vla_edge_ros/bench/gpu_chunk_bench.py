"""GPU chunk benchmark: our PyCUDA engine vs HF transformers (eager, and StaticCache + torch.compile) on one GPU.

Chunk = 32-token prefill of one frame against a full retained cache (kv budget 4096 tokens, pinned prefix
included) + ``decode_tokens`` greedy single-token steps over the 256 action rows, Qwen2.5-1.5B geometry with
random bf16 weights (generated here on the GPU). HF runs the same chunk: 32 frame embeddings against a cache
of the same length, then 8 greedy steps whose logits are the same 256 action rows.

Printed: our median / p99 per chunk (GPU time between events, and host wall time of ``run_chunk``), the HF
figures, the bandwidth floor (weight + KV bytes per chunk over a device-to-device copy bandwidth measured
here), our fraction of that floor, per-kernel time shares and peak VRAM. Tuning variants are timed too.

``--horizon-compare H`` (issue 22) also times an H-step action chunk (A = 7H action tokens) of the same geometry
and cache both ways: autoregressive (max(decode_tokens, A + 1) decode steps) and parallel (one pass over the A
slots, in 32-row tiles; its tuning variants: bench/gpu_horizon.py); the prediction is parallel decode ~ one prefill
pass per tile (docs/KERNEL_NOTES_MANY_ROWS.md, "Action chunks"); ``--horizon-hf compiled`` (the default) also
times HF StaticCache + torch.compile generating the same A + 1 tokens autoregressively in the same run
(``eager``: HF eager; ``none``: skip).

Usage (on the GPU machine):
    python -m vla_edge_ros.bench.gpu_chunk_bench [--chunks 200] [--parts ours,eager,compiled] [--json out.json]
    python -m vla_edge_ros.bench.gpu_chunk_bench --parts ours --no-variants --chunks 50 --horizon-compare 8
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import numpy as np

from vla_edge_ros.bench.gpu_report import print_report
from vla_edge_ros.engine.config import ModelConfig, qwen2_5_0_5b_dict, qwen2_5_1_5b_dict

INSTRUCTION = "pick up the object"  # 18 bytes


def pct(a, q):
    return float(np.percentile(np.asarray(a, np.float64), q))


def random_weights(torch, cfg: ModelConfig, seed: int = 0) -> dict:
    from vla_edge_ros.engine.checkpoint import expected_shapes
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            t = 1.0 + 0.1 * torch.randn(shape, generator=g, device="cuda")
        elif name.endswith(".bias"):
            t = 0.1 * torch.randn(shape, generator=g, device="cuda")
        else:
            t = 0.02 * torch.randn(shape, generator=g, device="cuda")
        out[name] = t.to(torch.bfloat16).contiguous()
    return out


def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted), through the driver."""
    import pycuda.driver as cuda
    a, b = cuda.mem_alloc(nbytes), cuda.mem_alloc(nbytes)
    cuda.memset_d8(a, 1, nbytes)
    e0, e1 = cuda.Event(), cuda.Event()
    cuda.memcpy_dtod(b, a, nbytes)
    times = []
    for _ in range(reps):
        e0.record()
        cuda.memcpy_dtod(b, a, nbytes)
        e1.record()
        e1.synchronize()
        times.append(e1.time_since(e0) / 1e3)
    a.free()
    b.free()
    return 2 * nbytes / float(np.median(times))


def bytes_per_chunk(cfg: ModelConfig, n_ctx: int, decode_tokens: int) -> dict:
    H, I, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    nkv = cfg.num_key_value_heads * cfg.head_dim
    nqkv = H + 2 * nkv
    weights = L * 2 * (nqkv * H + H * H + 2 * I * H + H * I) + 2 * cfg.n_action_bins * H
    kv_read = L * 2 * 2 * nkv  # bytes per key (K and V) over all layers
    prefill = weights + kv_read * n_ctx
    decode = sum(weights + kv_read * (n_ctx + i) for i in range(1, decode_tokens + 1))
    return {"weights_per_pass": weights, "prefill": prefill, "decode": decode, "chunk": prefill + decode}


def run_ours(cfg, weights_np, args, log) -> dict:
    from vla_edge_ros.bench import gpu_profile
    from vla_edge_ros.core.kv.manager import KVManager
    from vla_edge_ros.engine.cuda import CudaEngine
    prefix = len(INSTRUCTION.encode())
    kv = KVManager(args.budget, cfg.n_patches, prefix, policy=args.policy, embed_dim=cfg.hidden_size)
    t0 = time.perf_counter()
    eng = CudaEngine(cfg, weights_np, kv, instruction=INSTRUCTION, decode_tokens=args.decode_tokens,
                     max_vram_gb=args.max_vram_gb, log=log)
    setup_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    frames = [(0.02 * rng.standard_normal((cfg.n_patches, cfg.hidden_size))).astype(np.float32) for _ in range(8)]
    fid = [0]

    def chunk():
        x = frames[fid[0] % len(frames)] + np.float32(1e-3 * fid[0])
        r = eng.run_chunk(x, fid[0])
        fid[0] += 1
        return r

    while eng.kv.occupancy_tokens + cfg.n_patches <= args.budget:  # fill the cache to the budget
        chunk()
    n_ctx = len(eng.kv.context_slots())

    def measure(n):
        gpu, host, pf, dc = [], [], [], []
        split: dict[str, list] = {}
        for _ in range(n):
            r = chunk()
            for k, v in eng.host_profile_ms.items():
                split.setdefault(k, []).append(v)
            gpu.append(r.prefill_ms + r.decode_ms)
            host.append(r.total_ms)
            pf.append(r.prefill_ms)
            dc.append(r.decode_ms)
        return {"gpu_median_ms": pct(gpu, 50), "gpu_p99_ms": pct(gpu, 99), "host_median_ms": pct(host, 50),
                "host_p99_ms": pct(host, 99), "prefill_median_ms": pct(pf, 50), "decode_median_ms": pct(dc, 50),
                "chunks": n, "host_split_median_ms": {k: pct(v, 50) for k, v in split.items()}}

    out = {"setup_s": setup_s, "n_ctx": n_ctx, "variants": {}}
    if args.tune:
        eng.retune(**json.loads(args.tune))
    out["main"] = measure(args.chunks)
    base = dataclasses.asdict(eng.tuning)
    out["main"]["tuning"] = base
    from vla_edge_ros.engine.cuda.plan import LATE_TRIGGER_FAMILIES

    def late_but(*skip: str) -> dict:  # every kernel family's PDL trigger late except `skip`
        return {"late_trigger": ",".join(f for f in LATE_TRIGGER_FAMILIES if f not in skip)}

    variants = [  # each applied on top of the default tuning (the removed kernels' variants: docs/KERNEL_NOTES.md)
        ("PDL off", {"pdl": False}),
        ("graphs off", {"use_graphs": False}),
        ("late trigger none", {"late_trigger": ""}),
        ("late trigger qkv,attn,combine", {"late_trigger": "qkv,attn,combine"}),
        ("gemm v4 off (v9 GEMMs)", {"gemm_v4": ""}),
        ("gemm v4 all four", {"gemm_v4": "qkv,o,gateup,down"}),
        ("gemm v4 gateup only", {"gemm_v4": "gateup"}),
        ("gemm v4 down only", {"gemm_v4": "down"}),
        ("late trigger all (v9)", late_but()),
        *((f"late trigger all but {f}", late_but(f)) for f in ("combine", "attn", "qkv", "rmsnorm", "attn_pf", "gemm")),
        ("gemv min_ks 1024", {"gemv_min_ks": 1024}),
        ("gemv 1 split", {"gemv_target_blocks": 1}),
        ("gemm min_ks 512", {"gemm_min_ks": 512}),
        ("gemv target 396 blocks", {"gemv_target_blocks": 396}),
        ("gemv target 576 blocks", {"gemv_target_blocks": 576}),
    ]
    if args.variants == "short":
        variants = [v for v in variants if v[0] in ("PDL off", "graphs off", "late trigger none",
                                                    "gemm v4 off (v9 GEMMs)")]
    if args.variant_filter:
        keys = [k.strip() for k in args.variant_filter.split(",") if k.strip()]
        variants = [v for v in variants if any(k in v[0] for k in keys)]
    if not args.no_variants:
        for name, tune in variants:
            try:
                eng.retune(**{**base, "use_graphs": True, **tune})
                out["variants"][name] = measure(20 if name == "graphs off" else max(30, args.chunks // 4))
            except Exception as exc:  # a variant failing must not lose the rest of the figures
                out["variants"][name] = {"error": f"{type(exc).__name__}: {exc}"}
        eng.retune(**{**base, "use_graphs": True})
        out["main_repeat"] = measure(args.chunks)  # same version twice: the spread is the noise
    out["kernel_ms"] = gpu_profile.time_kernels(eng, reps=10)
    if args.ablate:
        out["ablation_ms"] = gpu_profile.time_ablations(eng, reps=10)
    out["peak_vram_bytes"] = eng.memory()["peak_bytes"]
    out["tracked_bytes"] = eng.memory()["current_bytes"]
    eng.close()
    return out


def run_timeline(cfg, weights_np, args, log) -> dict:
    """One chunk's kernel timeline from an engine built with VLA_TIMELINE (its own engine: the stamps cost a few
    atomics per block), after the cache is full and 20 warm-up chunks."""
    from vla_edge_ros.bench import gpu_profile
    from vla_edge_ros.core.kv.manager import KVManager
    from vla_edge_ros.engine.cuda import CudaEngine
    kv = KVManager(args.budget, cfg.n_patches, len(INSTRUCTION.encode()), policy=args.policy,
                   embed_dim=cfg.hidden_size)
    eng = CudaEngine(cfg, weights_np, kv, instruction=INSTRUCTION, decode_tokens=args.decode_tokens,
                     max_vram_gb=args.max_vram_gb, log=log, defines=("VLA_TIMELINE",))
    if args.tune:
        eng.retune(**json.loads(args.tune))
    rng = np.random.default_rng(1)
    fid = [0]

    def chunk():
        eng.run_chunk((0.02 * rng.standard_normal((cfg.n_patches, cfg.hidden_size))).astype(np.float32), fid[0])
        fid[0] += 1

    try:
        while eng.kv.occupancy_tokens + cfg.n_patches <= args.budget:
            chunk()
        for _ in range(20):
            chunk()
        rows, ph = gpu_profile.timeline(eng, chunk)
        return {"rows": rows, "pf_phases": None if ph is None else ph.tolist(), "n_kvh": cfg.num_key_value_heads,
                "nsplit": eng.kvc.nsplit}
    finally:
        eng.close()


def run_loop(cfg, weights_np, args, log) -> dict:
    """ROS-free run of core.inference_loop.InferenceLoop with the CUDA engine and a 60 Hz synthetic camera."""
    import threading
    from types import SimpleNamespace
    from vla_edge_ros.core.admission import AdmissionController
    from vla_edge_ros.core.double_buffer import DoubleBuffer
    from vla_edge_ros.core.inference_loop import InferenceLoop
    from vla_edge_ros.core.kv.manager import KVManager
    from vla_edge_ros.engine.cuda import CudaEngine
    kv = KVManager(args.budget, cfg.n_patches, len(INSTRUCTION.encode()), policy="semantic",
                   embed_dim=cfg.hidden_size)
    eng = CudaEngine(cfg, weights_np, kv, instruction=INSTRUCTION, decode_tokens=args.decode_tokens,
                     max_vram_gb=args.max_vram_gb, log=log)
    buf = DoubleBuffer()
    adm = AdmissionController(deadline_ms=33.0, safety_margin_ms=2.0, ema_alpha=0.2)
    chunk_ms, events = [], {}

    def on_event(kind, info):
        events[kind] = events.get(kind, 0) + 1

    loop = InferenceLoop(eng, buf, adm, period_ms=1000.0 / 30.0, on_action=lambda r, f: chunk_ms.append(r.total_ms),
                         on_event=on_event, decode_tokens=args.decode_tokens)
    loop.warmup(5, image_shape=(480, 640, 3))
    rng = np.random.default_rng(0)
    scenes = [rng.integers(0, 256, (480, 640, 3), dtype=np.uint8) for _ in range(4)]
    stop = threading.Event()
    sent = [0]

    def camera():
        period = 1.0 / 60.0
        t_next = time.perf_counter()
        while not stop.is_set():
            img = scenes[(sent[0] // 240) % len(scenes)].copy()  # a scene change every 4 s
            img[:16, :16] = sent[0] % 256
            buf.write(SimpleNamespace(frame_id=sent[0], image=img, stamp_ns=time.monotonic_ns()))
            sent[0] += 1
            t_next += period
            stop.wait(max(0.0, t_next - time.perf_counter()))

    cam = threading.Thread(target=camera, daemon=True)
    cam.start()
    loop.start()
    time.sleep(args.loop_seconds)
    stopped = loop.stop(10.0)
    stop.set()
    cam.join(2.0)
    st = loop.stats()
    eng.close()
    keys = ("frames_taken", "admitted", "refused", "completed", "deadline_misses", "errors", "late_discarded",
            "retried", "salient_frames")
    out = {k: st.get(k) for k in keys}
    out.update(frames_sent=sent[0], stopped_cleanly=stopped, events=events, seconds=args.loop_seconds,
               chunk_median_ms=pct(chunk_ms, 50) if chunk_ms else None,
               chunk_p99_ms=pct(chunk_ms, 99) if chunk_ms else None,
               chunk_max_ms=max(chunk_ms) if chunk_ms else None, warmup=loop.warmup_figures.get("chunk_ms"),
               last_error=st.get("last_error"))
    return out


def run_hf(torch, cfg_dict, tensors, n_ctx, args, compiled: bool) -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "rope_theta", "rms_norm_eps", "tie_word_embeddings")
    kw = {k: cfg_dict[k] for k in keys}
    try:
        conf = Qwen2Config(**kw, hidden_act="silu", use_sliding_window=False)
    except TypeError:
        theta = kw.pop("rope_theta")
        conf = Qwen2Config(**kw, hidden_act="silu", use_sliding_window=False,
                           rope_parameters={"rope_type": "default", "rope_theta": theta})
    conf._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(conf).to(torch.bfloat16)
    model.load_state_dict(tensors, strict=False)
    model.eval()
    H = cfg_dict["hidden_size"]
    off = cfg_dict["vocab_size"] - 256
    emb = tensors["model.embed_tokens.weight"]
    head = emb[off:]
    g = torch.Generator(device="cuda").manual_seed(1)
    ctx = 0.02 * torch.randn(1, n_ctx - 32, H, generator=g, device="cuda", dtype=torch.bfloat16)
    frame = 0.02 * torch.randn(1, 32, H, generator=g, device="cuda", dtype=torch.bfloat16)
    dec = args.decode_tokens
    inner = model.model
    with torch.no_grad():
        if not compiled:
            from transformers import DynamicCache
            try:
                cache = DynamicCache(config=conf)
            except TypeError:
                cache = DynamicCache()
            inner(inputs_embeds=ctx, past_key_values=cache, use_cache=True)

            def chunk():
                h = inner(inputs_embeds=frame, past_key_values=cache, use_cache=True).last_hidden_state[:, -1]
                for _ in range(dec):
                    tok = torch.argmax(h @ head.T, dim=-1) + off
                    h = inner(inputs_embeds=emb[tok][:, None], past_key_values=cache,
                              use_cache=True).last_hidden_state[:, -1]
                torch.argmax(h @ head.T, dim=-1)
                cache.crop(-(32 + dec))  # back to the retained context
        else:
            from transformers import StaticCache
            try:
                cache = StaticCache(config=conf, max_cache_len=n_ctx + max(64, dec + 8))
            except TypeError:
                cache = StaticCache(config=conf, max_batch_size=1, max_cache_len=n_ctx + max(64, dec + 8),
                                    device="cuda",
                                    dtype=torch.bfloat16)
            ctx_pos = torch.arange(n_ctx - 32, device="cuda")
            inner(inputs_embeds=ctx, past_key_values=cache, use_cache=True, cache_position=ctx_pos,
                  position_ids=ctx_pos[None])
            fwd = torch.compile(inner, mode="reduce-overhead", dynamic=False)
            pf_pos = torch.arange(n_ctx - 32, n_ctx, device="cuda")
            dec_pos = [torch.tensor([n_ctx + i], device="cuda") for i in range(dec)]

            def reset():
                # HF derives the write position from the cache's fill level (the explicit cache_position was not
                # honoured in runs on this transformers version), so between chunks the static cache is reset
                # and the retained context re-prefilled eagerly (untimed)
                cache.reset()
                inner(inputs_embeds=ctx, past_key_values=cache, use_cache=True, cache_position=ctx_pos,
                      position_ids=ctx_pos[None])

            def chunk():
                h = fwd(inputs_embeds=frame, past_key_values=cache, use_cache=True, cache_position=pf_pos,
                        position_ids=pf_pos[None]).last_hidden_state[:, -1].clone()
                for i in range(dec):
                    tok = torch.argmax(h @ head.T, dim=-1) + off
                    h = fwd(inputs_embeds=emb[tok][:, None], past_key_values=cache, use_cache=True,
                            cache_position=dec_pos[i], position_ids=dec_pos[i][None]).last_hidden_state[:, -1].clone()
                torch.argmax(h @ head.T, dim=-1)

        if not compiled:
            def reset():
                pass
        t0 = time.perf_counter()
        for _ in range(3):
            chunk()
            reset()
        torch.cuda.synchronize()
        warm_s = time.perf_counter() - t0
        times = []
        for _ in range(args.hf_chunks):
            t = time.perf_counter()
            chunk()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
            reset()
    del model
    torch.cuda.empty_cache()
    return {"median_ms": pct(times, 50), "p99_ms": pct(times, 99), "warmup_s": warm_s, "chunks": len(times)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--geometry", choices=["1.5b", "0.5b"], default="1.5b")
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--decode-tokens", type=int, default=8)
    ap.add_argument("--chunks", type=int, default=200)
    ap.add_argument("--hf-chunks", type=int, default=20)
    ap.add_argument("--policy", default="fifo")
    ap.add_argument("--max-vram-gb", type=float, default=8.0)
    ap.add_argument("--parts", default="ours,eager,compiled")
    ap.add_argument("--no-variants", action="store_true")
    ap.add_argument("--ablate", action="store_true",
                    help="also time a chunk graph without each kernel family (its in-chain cost)")
    ap.add_argument("--variants", choices=["full", "short"], default="full")
    ap.add_argument("--variant-filter", default="",
                    help="comma-separated substrings: time only the variants whose name contains one")
    ap.add_argument("--timeline", action="store_true",
                    help="also stamp one chunk's kernels (an engine built with VLA_TIMELINE) and print the "
                         "decode pass's per-kernel critical time")
    ap.add_argument("--tune", default="", help='JSON tuning applied before the main figure, e.g. {"pdl": false}')
    ap.add_argument("--json", default="")
    ap.add_argument("--horizon-compare", type=int, default=0, metavar="H",
                    help="also time an H-step action chunk autoregressive vs parallel (A = 7H slots; issue 22)")
    ap.add_argument("--horizon-hf", choices=["compiled", "eager", "none"], default="compiled",
                    help="with --horizon-compare: HF generating the same A + 1 tokens autoregressively, same run")
    ap.add_argument("--loop-seconds", type=float, default=0.0,
                    help="also run core.inference_loop.InferenceLoop this long with a 60 Hz synthetic camera")
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))

    from vla_edge_ros.bench.gpu_session import run_on_gpu

    def body(cuda) -> int:
        import torch
        return _main(args, parts, torch, cuda)
    return run_on_gpu("gpu_chunk_bench", body)


def _main(args, parts, torch, cuda) -> int:
    cfg_dict = qwen2_5_1_5b_dict() if args.geometry == "1.5b" else qwen2_5_0_5b_dict()
    cfg = ModelConfig.from_json(cfg_dict)
    res: dict = {"device": cuda.Device(0).name(), "geometry": args.geometry, "budget": args.budget,
                 "geometry_layers": cfg.num_hidden_layers, "decode_tokens": args.decode_tokens}
    bw = copy_bandwidth()
    res["copy_bandwidth_Bps"] = bw
    tensors = random_weights(torch, cfg)
    logs = []
    n_ctx = args.budget - (args.budget - len(INSTRUCTION.encode())) % cfg.n_patches
    if "ours" in parts:
        weights_np = {k: v.view(torch.int16).cpu().numpy().view(np.uint16) for k, v in tensors.items()}
        res["ours"] = run_ours(cfg, weights_np, args, logs.append)
        n_ctx = res["ours"]["n_ctx"]
        if args.timeline:
            try:
                res["timeline"] = run_timeline(cfg, weights_np, args, logs.append)
            except Exception as exc:
                res["timeline"] = {"error": f"{type(exc).__name__}: {exc}"}
        if args.loop_seconds > 0:
            try:
                res["loop"] = run_loop(cfg, weights_np, args, logs.append)
            except Exception as exc:
                res["loop"] = {"error": f"{type(exc).__name__}: {exc}"}
        if args.horizon_compare:
            try:
                from vla_edge_ros.bench.gpu_horizon import run_horizon_compare
                res["horizon_compare"] = run_horizon_compare(cfg_dict, weights_np, args, logs.append)
            except Exception as exc:
                res["horizon_compare"] = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"horizon compare failed: {res['horizon_compare']['error']}")
        del weights_np
    res["n_ctx"] = n_ctx
    hc = res.get("horizon_compare", {})  # (set only with part "ours")
    if hc and "parallel" in hc and args.horizon_hf != "none":
        steps = hc["autoregressive"]["decode_steps"]
        try:
            hf = run_hf(torch, cfg_dict, tensors, n_ctx, argparse.Namespace(**{**vars(args), "decode_tokens": steps}),
                        compiled=args.horizon_hf == "compiled")
            hc["hf_" + args.horizon_hf] = hf
            par = hc["parallel"]["gpu_median_ms"]
            print(f"H={args.horizon_compare} HF {args.horizon_hf} autoregressive ({steps} steps after the frame): "
                  f"median {hf['median_ms']:.3f} ms (wall) -> parallel {par:.3f} ms is {hf['median_ms'] / par:.1f}x "
                  f"faster; our autoregressive {hc['autoregressive']['gpu_median_ms']:.3f} ms")
        except Exception as exc:
            hc["hf_" + args.horizon_hf] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"horizon HF failed: {exc}")
    res["bytes"] = bytes_per_chunk(cfg, n_ctx, args.decode_tokens)
    res["floor_ms"] = res["bytes"]["chunk"] / bw * 1e3
    for part, compiled in (("eager", False), ("compiled", True)):
        if part in parts:
            try:
                res["hf_" + part] = run_hf(torch, cfg_dict, tensors, n_ctx, args, compiled)
            except Exception as exc:
                res["hf_" + part] = {"error": f"{type(exc).__name__}: {exc}"}
    for line in logs:
        print(line)
    print_report(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0



if __name__ == "__main__":
    sys.exit(main())
