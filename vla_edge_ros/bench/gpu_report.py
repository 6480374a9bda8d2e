"""The GPU chunk benchmark's report: the text it prints from its result dictionary, issue 4's speed verdict, and the
kernel-timeline summaries. Pure functions of the JSON the benchmark writes, so they are tested without a GPU
(test/test_gpu_bench_report.py)."""
from __future__ import annotations

import json

import numpy as np


PF_PHASES = ("wait", "own keys staged", "query fragments", "S / softmax / PV", "partials stored")


def pf_phase_summary(phases, release_us: float, nsplit: int, n_kvh: int, slowest: int = 4) -> list[str]:
    """Lines describing the last prefill attention launch's per-block phase ends (gpu_profile.timeline's second
    result: (blocks, 5) us, NaN = not reached; block b = split + nsplit * (kv head + n_kvh * z), z a third grid
    dimension if the kernel has one): per phase the median and the max over blocks of (end - the grid's release),
    then the slowest blocks at the last phase as (split, kv head[, z])."""
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
    spread (last - first block), count. For the layered decode (six kernels per layer); gemv_resid is o_proj
    unless it is the layer's last kernel (down)."""
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
        if o["variants"]:
            print("\nvariants (gpu median / p99 ms, wall median):")
            for k, v in o["variants"].items():
                if "error" in v:
                    print(f"  {k:18s} ERROR {v['error']}")
                else:
                    print(f"  {k:18s} {v['gpu_median_ms']:8.3f} {v['gpu_p99_ms']:8.3f} {v['host_median_ms']:8.3f}")
