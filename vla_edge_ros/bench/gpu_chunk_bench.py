"""GPU chunk benchmark: our PyCUDA engine vs HF transformers (eager, and StaticCache + torch.compile) on one GPU.

Chunk = 32-token prefill of one frame against a full retained cache (kv budget 4096 tokens, pinned prefix
included) + ``decode_tokens`` greedy single-token steps over the 256 action rows, Qwen2.5-1.5B geometry with
random bf16 weights (generated here on the GPU). HF runs the same chunk: 32 frame embeddings against a cache
of the same length, then 8 greedy steps whose logits are the same 256 action rows.

Printed: our median / p99 per chunk (GPU time between events, and host wall time of ``run_chunk``), the HF
figures, the bandwidth floor (weight + KV bytes per chunk over a device-to-device copy bandwidth measured
here), our fraction of that floor, per-kernel time shares and peak VRAM. Tuning variants are timed too.

Usage (on the GPU machine):
    python -m vla_edge_ros.bench.gpu_chunk_bench [--chunks 200] [--parts ours,eager,compiled] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

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
    from vla_edge_ros.core.kv.manager import KVManager
    from vla_edge_ros.engine.cuda_backend import CudaEngine
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
    out["main"]["tuning"] = dict(eng.tuning)
    base = dict(eng.tuning)
    from vla_edge_ros.engine.cuda_backend import LATE_TRIGGER_FAMILIES

    def late_but(*skip: str) -> dict:  # every kernel family's PDL trigger late except `skip`
        return {"late_trigger": ",".join(f for f in LATE_TRIGGER_FAMILIES if f not in skip)}

    variants = [  # each applied on top of the default tuning
        ("dataflow decode", {"decode_kernel": "dataflow"}),
        ("persistent decode (v5)", {"decode_kernel": "persistent"}),
        ("persistent, 1 block/SM", {"decode_kernel": "persistent", "pd_blocks_per_sm": 1}),
        ("PDL off", {"pdl": False}),
        ("run-2 kernels (simt decode attn, wpb 4)", {"decode_attn": "simt", "gemm_wpb": 4, "gemm_silu_wpb": 4}),
        ("graphs off", {"use_graphs": False}),
        ("gemm v2 (whole A slice)", {"gemm_version": 2}),
        ("gemm v2, PDL off", {"gemm_version": 2, "pdl": False}),
        ("gemm wpb 4", {"gemm_wpb": 4}),
        ("silu wpb 4", {"gemm_silu_wpb": 4}),
        ("prefill kps 128", {"attn_prefill_kps": 128}),
        ("prefill kps 256", {"attn_prefill_kps": 256}),
        ("decode kps 128", {"attn_decode_kps": 128}),
        ("combine two pass", {"combine": "two_pass"}),
        ("prefill combine vec 1", {"combine_prefill_vec": 1}),
        ("prefill combine vec 2", {"combine_prefill_vec": 2}),
        ("decode combine vec 2", {"combine_decode_vec": 2}),
        ("decode combine vec 4", {"combine_decode_vec": 4}),
        ("K/V L2 prefetch off", {"kv_l2_prefetch": False}),
        ("late trigger none", {"late_trigger": ""}),
        ("late trigger qkv,attn,combine", {"late_trigger": "qkv,attn,combine"}),
        ("gemm v4 off (v9 GEMMs)", {"gemm_v4": ""}),
        ("gemm v4 all four", {"gemm_v4": "qkv,o,gateup,down"}),
        ("gemm v4 gateup only", {"gemm_v4": "gateup"}),
        ("gemm v4 down only", {"gemm_v4": "down"}),
        ("late trigger all (v9)", late_but()),
        ("merge + o_proj fused", {"merge_oproj": True}),
        *((f"late trigger all but {f}", late_but(f)) for f in ("combine", "attn", "qkv", "rmsnorm", "attn_pf", "gemm")),
        ("gemv min_ks 1024", {"gemv_min_ks": 1024}),
        ("gemv 1 split", {"gemv_target_blocks": 1}),
        ("gemm min_ks 512", {"gemm_min_ks": 512}),
        ("gemv target 396 blocks", {"gemv_target_blocks": 396}),
        ("gemv target 576 blocks", {"gemv_target_blocks": 576}),
    ]
    if args.variants == "short":
        variants = variants[:3] + [v for v in variants if v[0] in ("graphs off", "decode kps 128", "prefill kps 128",
                                                        "combine two pass", "K/V L2 prefetch off",
                                                        "late trigger none")]
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
    out["decode_phase_share"] = eng.decode_phase_profile(chunks=10, run_chunk=chunk)
    try:
        out["dataflow_phase_us"] = eng.dataflow_phase_profile(chunks=10, run_chunk=chunk)
        try:
            eng.retune(decode_kernel="dataflow")
            chunk()
            trace = eng.dataflow_tile_trace()
        finally:
            eng.retune(**{**base, "use_graphs": True})
        if trace is not None:
            out["dataflow_tile_trace_us"] = [[[None if np.isnan(v) else round(float(v), 3) for v in r] for r in b]
                                             for b in trace]
    except Exception as exc:  # a failing dataflow kernel must not lose the rest of the figures
        out["dataflow_phase_us"] = {"error": f"{type(exc).__name__}: {exc}"}
    out["kernel_ms"] = eng.time_kernels(reps=10)
    if args.ablate:
        out["ablation_ms"] = eng.time_ablations(reps=10)
    out["peak_vram_bytes"] = eng.memory()["peak_bytes"]
    out["tracked_bytes"] = eng.memory()["current_bytes"]
    eng.close()
    return out


def run_timeline(cfg, weights_np, args, log) -> dict:
    """One chunk's kernel timeline from an engine built with VLA_CUDA_TIMELINE=1 (its own engine: the stamps cost
    a few atomics per block), after the cache is full and 20 warm-up chunks."""
    from vla_edge_ros.core.kv.manager import KVManager
    from vla_edge_ros.engine.cuda_backend import CudaEngine
    os.environ["VLA_CUDA_TIMELINE"] = "1"
    try:
        kv = KVManager(args.budget, cfg.n_patches, len(INSTRUCTION.encode()), policy=args.policy,
                       embed_dim=cfg.hidden_size)
        eng = CudaEngine(cfg, weights_np, kv, instruction=INSTRUCTION, decode_tokens=args.decode_tokens,
                         max_vram_gb=args.max_vram_gb, log=log)
        if args.tune:
            eng.retune(**json.loads(args.tune))
    finally:
        os.environ.pop("VLA_CUDA_TIMELINE", None)
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
        rows = eng.timeline(chunk)
        ph = eng.timeline_pf_phases
        return {"rows": rows, "pf_phases": None if ph is None else ph.tolist(), "n_kvh": eng.n_kvh,
                "nsplit": eng.nsplit_pf}
    finally:
        eng.close()


PF_PHASES = ("wait", "own keys staged", "query fragments", "S / softmax / PV", "partials stored")


def pf_phase_summary(phases, release_us: float, nsplit: int, n_kvh: int, slowest: int = 4) -> list[str]:
    """Lines describing the last prefill attention launch's per-block phase ends (engine.timeline_pf_phases:
    (blocks, 5) us, NaN = not reached; block b = split + nsplit * (kv head + n_kvh * z), z the token half of the
    token-split kernel): per phase the median and the max over blocks of (end - the grid's release), then the
    slowest blocks at the last phase as (split, kv head[, z])."""
    a = np.asarray(phases, dtype=np.float64) - release_us
    out = []
    for i, name in enumerate(PF_PHASES):
        col = a[:, i]
        out.append(f"  {name:20s} median {np.nanmedian(col):7.2f}  max {np.nanmax(col):7.2f}  "
                   f"(n={int(np.sum(~np.isnan(col)))})")
    last = a[:, -1]
    order = [int(b) for b in np.argsort(-np.where(np.isnan(last), -np.inf, last), kind="stable")[:slowest]]
    z = len(a) > nsplit * n_kvh

    def where(b: int) -> str:
        return f"{b % nsplit}, {b // nsplit % n_kvh}" + (f", {b // (nsplit * n_kvh)}" if z else "")
    out.append(f"  slowest blocks (split, kv head{', z' if z else ''}: stored at, us): " + ", ".join(
        f"({where(b)}: {last[b]:.2f})" for b in order))
    return out


def timeline_summary(rows: list, layers: int) -> list[tuple[str, float, float, float, int]]:
    """Per kernel name in the decode pass's middle (steps 2.., layers 1..L-2): mean time from its first block's
    release (PDL wait passed) to the next kernel's, mean lead (release - start of its first block), mean release
    spread (last - first block), count. For the layered decode (kernels per layer: six, or five with the merge and
    o_proj fused); gemv_resid is o_proj unless it is the layer's last kernel (down)."""
    dec0 = next(i for i, r in enumerate(rows) if r[0] == "embed_gather")
    per_step = (len(rows) - dec0) // max(1, sum(1 for r in rows if r[0] == "embed_gather"))
    kpl = (per_step - 3) // layers  # embed, then kpl per layer, then logits, argmax
    acc: dict[str, list] = {}
    for i in range(dec0 + per_step, len(rows) - 1):
        pos = (i - dec0) % per_step
        layer = (pos - 1) // kpl
        if not 1 <= layer <= layers - 2:
            continue
        n, start, rel, rel_last = rows[i]
        key = n if n != "gemv_resid" else ("gemv_resid down" if (pos - 1) % kpl == kpl - 1 else "gemv_resid o_proj")
        acc.setdefault(key, []).append((rows[i + 1][2] - rel, rel - start, rel_last - rel))
    return [(k, *np.mean(np.asarray(v), axis=0).tolist(), len(v)) for k, v in acc.items()]


def run_loop(cfg, weights_np, args, log) -> dict:
    """ROS-free run of core.inference_loop.InferenceLoop with the CUDA engine and a 60 Hz synthetic camera."""
    import threading
    from types import SimpleNamespace
    from vla_edge_ros.core.admission import AdmissionController
    from vla_edge_ros.core.double_buffer import DoubleBuffer
    from vla_edge_ros.core.inference_loop import InferenceLoop
    from vla_edge_ros.core.kv.manager import KVManager
    from vla_edge_ros.engine.cuda_backend import CudaEngine
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
                cache = StaticCache(config=conf, max_cache_len=n_ctx + 64)
            except TypeError:
                cache = StaticCache(config=conf, max_batch_size=1, max_cache_len=n_ctx + 64, device="cuda",
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
                    help="also stamp one chunk's kernels (an engine built with VLA_CUDA_TIMELINE=1) and print the "
                         "decode pass's per-kernel critical time")
    ap.add_argument("--tune", default="", help='JSON tuning applied before the main figure, e.g. {"pdl": false}')
    ap.add_argument("--json", default="")
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
        del weights_np
    res["n_ctx"] = n_ctx
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


GOAL_MEDIAN_MS, GOAL_P99_MS, GOAL_VS_COMPILED = 7.0, 8.0, 3.0  # issue 4's speed goal


def goal_verdict(res: dict) -> list[tuple[str, bool | None]]:
    """Issue 4's three speed criteria on the wall-clock figures (what a robot waits for; the GPU-event times are
    lower): median <= 7 ms, p99 <= 8 ms, and >= 3x the compiled HF median measured in the same run. None where
    the run lacks the figure (HF compiled not measured or failed)."""
    m = (res.get("ours") or {}).get("main")
    if not m:
        return []
    out: list[tuple[str, bool | None]] = [
        (f"median {m['host_median_ms']:.2f} ms <= {GOAL_MEDIAN_MS:g} ms", m["host_median_ms"] <= GOAL_MEDIAN_MS),
        (f"p99 {m['host_p99_ms']:.2f} ms <= {GOAL_P99_MS:g} ms", m["host_p99_ms"] <= GOAL_P99_MS)]
    h = res.get("hf_compiled")
    if h and "error" not in h:
        ratio = h["median_ms"] / m["host_median_ms"]
        out.append((f"{ratio:.2f}x HF compiled >= {GOAL_VS_COMPILED:g}x", ratio >= GOAL_VS_COMPILED))
    else:
        out.append((f"vs HF compiled: not measured in this run (>= {GOAL_VS_COMPILED:g}x required)", None))
    return out


def print_report(res: dict) -> None:
    b = res["bytes"]
    if "loop" in res:
        print("\n== InferenceLoop (no ROS), backend cuda, 60 Hz synthetic camera, 30 Hz cycles, deadline 33 ms ==")
        print(json.dumps(res["loop"], indent=1, default=str))
    print(f"\n== gpu_chunk_bench: {res['device']}, Qwen2.5-{res['geometry']} geometry, bf16, "
          f"context {res['n_ctx']} tokens (budget {res['budget']}) ==")
    print(f"copy bandwidth (d2d, read+write): {res['copy_bandwidth_Bps'] / 1e12:.2f} TB/s; bytes per chunk "
          f"{b['chunk'] / 1e9:.2f} GB (weights {b['weights_per_pass'] / 1e9:.3f} GB/pass x 9 + KV); "
          f"floor {res['floor_ms']:.2f} ms/chunk")
    rows = []
    o = res.get("ours")
    if o:
        m = o["main"]
        rows.append(("ours (PyCUDA, graphs)", m["gpu_median_ms"], m["gpu_p99_ms"], m["host_median_ms"],
                     m["host_p99_ms"]))
        if "main_repeat" in o:
            r = o["main_repeat"]
            rows.append(("ours, repeated", r["gpu_median_ms"], r["gpu_p99_ms"], r["host_median_ms"], r["host_p99_ms"]))
    for k, name in (("hf_eager", "HF eager (DynamicCache)"), ("hf_compiled", "HF StaticCache+compile(r-o)")):
        h = res.get(k)
        if h and "error" not in h:
            rows.append((name, float("nan"), float("nan"), h["median_ms"], h["p99_ms"]))
        elif h:
            print(f"{name}: FAILED {h['error']}")
    print(f"\n{'':32s} {'gpu med':>9s} {'gpu p99':>9s} {'wall med':>9s} {'wall p99':>9s}   (ms per chunk)")
    for r in rows:
        print(f"{r[0]:32s} {r[1]:9.3f} {r[2]:9.3f} {r[3]:9.3f} {r[4]:9.3f}")
    if o:
        m = o["main"]
        print(f"\nours: prefill {m['prefill_median_ms']:.3f} ms + decode {m['decode_median_ms']:.3f} ms "
              f"({m['decode_median_ms'] / res.get('decode_tokens', 8):.3f} ms/step); floor / ours(gpu median) = "
              f"{res['floor_ms'] / m['gpu_median_ms']:.1%}; wall median {m['host_median_ms']:.3f} ms")
        for k, name in (("hf_eager", "HF eager"), ("hf_compiled", "HF compiled")):
            h = res.get(k)
            if h and "error" not in h:
                print(f"speed-up vs {name}: {h['median_ms'] / m['host_median_ms']:.1f}x (wall medians)")
        if m.get("host_split_median_ms"):
            print("wall-clock split (host medians, ms): " + ", ".join(
                f"{k} {v:.3f}" for k, v in m["host_split_median_ms"].items()))
        print(f"peak VRAM (tracked): {o['peak_vram_bytes'] / 2**30:.3f} GiB; engine setup {o['setup_s']:.1f} s")
        verdict = goal_verdict(res)
        met = all(v is True for _, v in verdict)
        print("speed goal (wall clock): " + "; ".join(f"{t}: {'yes' if v else ('?' if v is None else 'NO')}"
                                                     for t, v in verdict) + f" -> {'MET' if met else 'NOT MET'}")
        km = o["kernel_ms"]
        tot = sum(km.values())
        print(f"\nper-kernel family (isolated graphs, ms per chunk; sum {tot:.3f} vs chunk {m['gpu_median_ms']:.3f}):")
        for k, v in sorted(km.items(), key=lambda kv: -kv[1]):
            print(f"  {k:16s} {v:8.3f} ms  {v / tot:6.1%}")
        tl = res.get("timeline") or {}
        if "error" in tl:
            print(f"\ntimeline: ERROR {tl['error']}")
        elif tl:
            print("\ndecode timeline (us, mean over steps 2.. and the middle layers): release -> next release, "
                  "launched ahead of its release, release spread over blocks")
            for k, crit, lead, spread, n in timeline_summary(tl["rows"], res["geometry_layers"]):
                print(f"  {k:20s} {crit:7.2f} {lead:7.2f} {spread:7.2f}   (n={n})")
            rows = tl["rows"]
            dec0 = next(i for i, r in enumerate(rows) if r[0] == "embed_gather")
            print(f"prefill {rows[dec0][2] - rows[0][1]:.1f} us, decode {rows[-1][2] - rows[dec0][2]:.1f} us (to the "
                  "last kernel's release); one layer of decode step 4 (start / release / last release, us):")
            per_step = (len(rows) - dec0) // sum(1 for r in rows if r[0] == "embed_gather")
            kpl = (per_step - 3) // res["geometry_layers"]
            i0 = dec0 + 3 * per_step + 1 + kpl * 10
            for n, a, b, c in rows[i0:i0 + kpl + 1]:
                print(f"  {n:20s} {a:10.2f} {b:10.2f} {c:10.2f}")
            pf_layer = dec0 // res["geometry_layers"]  # the prefill's launches per layer (+ 3 after the last)
            i0 = pf_layer * (res["geometry_layers"] // 2)
            print("one prefill layer (start / release / last release / release -> next release, us):")
            for k in range(i0, min(i0 + pf_layer, dec0 - 1)):
                n, a, b, c = rows[k]
                print(f"  {n:20s} {a:10.2f} {b:10.2f} {c:10.2f} {rows[k + 1][2] - b:8.2f}")
            if tl.get("pf_phases"):
                last_attn = max(k for k in range(dec0) if rows[k][0].startswith("attn_prefill"))
                print("the last prefill attention's blocks, phase ends (us after its release; next kernel's release "
                      f"at {rows[last_attn + 1][2] - rows[last_attn][2]:.2f}):")
                for line in pf_phase_summary(tl["pf_phases"], rows[last_attn][2], tl["nsplit"], tl["n_kvh"]):
                    print(line)
        ab = o.get("ablation_ms") or {}
        if ab:
            print(f"\nin-chain cost per family (one graph per chunk {ab['full']:.3f} ms minus the graph without "
                  "the family, ms per chunk):")
            for k, v in sorted(((k, v) for k, v in ab.items() if k != "full"), key=lambda kv: -kv[1]):
                print(f"  {k:16s} {v:8.3f} ms")
        share = o.get("decode_phase_share") or {}
        if share:
            pv = o["variants"].get("persistent decode (v5)", {})
            step_ms = pv.get("decode_median_ms", m["decode_median_ms"]) / res.get("decode_tokens", 8)
            print(f"\npersistent decode, share of a step by phase (block 0's clock at each barrier exit, barrier wait "
                  f"included; us per layer at its {step_ms:.3f} ms/step):")
            for k, v in share.items():
                print(f"  {k:10s} {v:6.1%}  {v * step_ms * 1e3 / res['geometry_layers']:7.2f} us")
        tr = o.get("dataflow_tile_trace_us")
        if tr:
            nan = float("nan")
            for b, who in enumerate(("block 0", "last block")):
                print(f"\ndataflow tile trace, {who}, last layer (us after the first stamp): tile issued ready "
                      "dot-done")
                for i in range(len(tr[b][0])):
                    v = [tr[b][k][i] for k in range(len(tr[b]))]
                    if any(x is not None for x in v):
                        print(f"  {i:3d} " + " ".join(f"{x if x is not None else nan:7.2f}" for x in v))
        dfp = o.get("dataflow_phase_us") or {}
        if dfp:
            if "error" in dfp:
                print(f"\ndataflow decode phase profile: ERROR {dfp['error']}")
            else:
                print("\ndataflow decode, us per layer by phase (block 0's %globaltimer after each counter wait; "
                      f"start to x ready {dfp['start']:.2f} us):")
                for k, v in dfp.items():
                    if k != "start":
                        print(f"  {k:10s} {v:7.2f} us")
                print(f"  {'layer':10s} {sum(v for k, v in dfp.items() if k != 'start'):7.2f} us")
        if o["variants"]:
            print("\nvariants (gpu median / p99 ms, wall median):")
            for k, v in o["variants"].items():
                if "error" in v:
                    print(f"  {k:18s} ERROR {v['error']}")
                else:
                    print(f"  {k:18s} {v['gpu_median_ms']:8.3f} {v['gpu_p99_ms']:8.3f} {v['host_median_ms']:8.3f}")


if __name__ == "__main__":
    sys.exit(main())
