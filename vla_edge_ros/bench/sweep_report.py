"""The eviction-policy sweep's report (bench/sweep.py runs it): the table, the plots and report.md.

Split from the runner so that each file can be held in mind: this part only reads the summaries that
``sweep.summarise`` builds (one per policy and setting) and never starts a process.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

import numpy as np

from vla_edge_ros import params as registry
from vla_edge_ros.bench.figures import save_figure

VRAM_CEILING_MB = 8.0 * 1024
SETTINGS: dict[str, dict[str, Any]] = {
    "nominal": {},
    # Long context: 255 frames of context (8160 slots = 255 x 32; budget + decode scratch must stay below the
    # tiny model's 8192 positions) and a 64-frame window. Prefill cost grows with the retained context, so the
    # admission controller refuses more chunks as the cache fills -- unless the policy keeps less context.
    "long_context": {"kv_budget_tokens": 8160, "window_frames": 64},
    # Tight deadline: a 20 ms cycle leaves little slack over the base chunk cost; admission refuses most chunks
    # whatever the policy, and the miss rate shows how good the cost estimate is near the limit.
    "tight_deadline": {"deadline_ms": 20.0},
}


def retention_at(result: dict, k: int) -> Optional[float]:
    sal = result.get("saliency")
    if not isinstance(sal, dict):
        return None
    entry = (sal.get("retention") or {}).get(str(k))
    return entry.get("fraction") if isinstance(entry, dict) else None


def _fmt(v, digits=1, pct=False) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    if pct:
        return f"{100.0 * v:.{digits}f}%"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def report_table(results: dict[str, dict[str, dict]]) -> str:
    """Markdown table: one row per (setting, policy)."""
    head = ("| setting | policy | admitted | refused | miss rate | p50 / p95 / p99 ms | fresh | fallback | hold "
            "| peak RSS MB | peak VRAM MB (of 8192) | KV max / budget | frames recv / dropped | "
            "salient kept @32 / @128 | action MAE |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for setting, by_policy in results.items():
        for policy, r in by_policy.items():
            lat = r["latency_ms"]
            ae = (r.get("action_error_vs_recorded") or {}).get("mae")
            if r.get("error"):
                lines.append(f"| {setting} | {policy} | FAILED: {r['error']} |" + " |" * 13)
                continue
            lines.append(
                f"| {setting} | {policy} | {r['chunks']['admitted']} | {r['chunks']['refused']} | "
                f"{_fmt(r['deadline_miss_rate'], pct=True)} | {_fmt(lat['p50'])} / {_fmt(lat['p95'])} / "
                f"{_fmt(lat['p99'])} | {_fmt(r['fresh_rate'], pct=True)} | {_fmt(r['fallback_rate'], pct=True)} | "
                f"{_fmt(r['hold_rate'], pct=True)} | {_fmt(r['memory']['peak_rss_mb'])} | "
                f"{_fmt(r['memory']['peak_vram_mb'])} | {r['kv']['max_occupancy_tokens']} / "
                f"{r['kv']['budget_tokens']} | {r['frames']['received']} / "
                f"{r['frames']['overwritten_before_inference']} | {_fmt(retention_at(r, 32), pct=True, digits=0)} / "
                f"{_fmt(retention_at(r, 128), pct=True, digits=0)} | "
                f"{_fmt(ae, 3)} |")
    return "\n".join(lines)


def latency_curve(r: dict) -> tuple[np.ndarray, np.ndarray]:
    """(latency ms, cumulative fraction): from raw samples when the runtime exports them, else through the
    exported percentiles (p50, p95, p99, max) -- a coarse CDF, labelled as such in the plot."""
    s = r.get("latency_samples_ms")
    if s:
        x = np.sort(np.asarray(s, float))
        return x, np.arange(1, len(x) + 1) / len(x)
    lat = r["latency_ms"]
    pts = [(lat.get(k), q) for k, q in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99), ("max", 1.0))]
    pts = [(x, q) for x, q in pts if x is not None]
    if not pts:
        return np.zeros(0), np.zeros(0)
    return np.array([0.0] + [x for x, _ in pts]), np.array([0.0] + [q for _, q in pts])


def make_plots(results: dict[str, dict[str, dict]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    settings = list(results)
    # latency CDF
    fig, axes = plt.subplots(1, len(settings), figsize=(6 * len(settings), 4), squeeze=False)
    for ax, setting in zip(axes[0], settings):
        coarse = False
        for policy, r in results[setting].items():
            x, y = latency_curve(r)
            if not x.size:
                continue
            if r.get("latency_samples_ms"):
                ax.step(x, y, where="post", label=policy)
            else:  # only percentiles exported: join them, markers show the measured points
                coarse = True
                ax.plot(x[1:], y[1:], marker="o", label=policy)
        deadline = results[setting][next(iter(results[setting]))]["params"].get("deadline_ms",
                                                                                registry.BY_NAME["deadline_ms"].default)
        ax.axvline(deadline, color="k", ls="--", lw=1, label=f"deadline {deadline:g} ms")
        ax.set_title(f"chunk latency CDF ({setting})" + (": p50/p95/p99/max points" if coarse else ""))
        ax.set_xlabel("chunk latency (ms)")
        ax.set_ylabel("fraction of admitted chunks")
        ax.legend()
        ax.grid(alpha=0.3)
    paths.append(save_figure(fig, out / "latency_cdf.png"))
    # rates
    metrics = [("deadline_miss_rate", "deadline miss"), ("refusal_rate", "refused"), ("fallback_rate", "fallback"),
               ("hold_rate", "hold")]
    fig, axes = plt.subplots(1, len(settings), figsize=(6 * len(settings), 4), squeeze=False)
    for ax, setting in zip(axes[0], settings):
        pols = list(results[setting])
        width = 0.8 / len(metrics)
        for j, (key, label) in enumerate(metrics):
            vals = [100.0 * (results[setting][p][key] or 0.0) for p in pols]
            ax.bar(np.arange(len(pols)) + j * width, vals, width, label=label)
        ax.set_xticks(np.arange(len(pols)) + width * (len(metrics) - 1) / 2, pols)
        ax.set_ylabel("%")
        ax.set_title(f"miss / refusal / fallback / hold rates ({setting})")
        ax.legend()
        ax.grid(axis="y", alpha=0.3)
    paths.append(save_figure(fig, out / "rates.png"))
    # memory and KV occupancy over time
    fig, axes = plt.subplots(2, len(settings), figsize=(6 * len(settings), 7), squeeze=False)
    for col, setting in enumerate(settings):
        for policy, r in results[setting].items():
            tl = r["timeline"]
            t = [s["t_s"] for s in tl if s.get("rss_mb") is not None]
            axes[0][col].plot(t, [s["rss_mb"] for s in tl if s.get("rss_mb") is not None], label=policy)
            kv = [(s["t_s"], s["kv_occupancy_tokens"]) for s in tl if s.get("kv_occupancy_tokens") is not None]
            if kv:
                axes[1][col].plot(*zip(*kv), label=policy, drawstyle="steps-post")
        vram = max((r["memory"]["peak_vram_mb"] for r in results[setting].values()), default=0.0)
        axes[0][col].set_title(f"runtime memory ({setting}); ceiling {VRAM_CEILING_MB:.0f} MB"
                               + (f", peak VRAM {vram:.0f} MB" if vram else " (CPU: RSS)"))
        axes[0][col].set_ylabel("RSS (MB)")
        budget = next(iter(results[setting].values()))["kv"]["budget_tokens"]
        if budget:
            axes[1][col].axhline(budget, color="k", ls="--", lw=1, label="budget")
        axes[1][col].set_title(f"KV occupancy ({setting})")
        axes[1][col].set_ylabel("tokens")
        axes[1][col].set_xlabel("time since start (s)")
        for ax in axes[:, col]:
            ax.legend()
            ax.grid(alpha=0.3)
    paths.append(save_figure(fig, out / "memory.png"))
    # saliency retention
    fig, axes = plt.subplots(1, len(settings), figsize=(6 * len(settings), 4), squeeze=False)
    for ax, setting in zip(axes[0], settings):
        any_data = False
        for policy, r in results[setting].items():
            ret = (r.get("saliency") or {}).get("retention") or {}
            pts = sorted((int(k), v["fraction"]) for k, v in ret.items()
                         if isinstance(v, dict) and v.get("fraction") is not None)
            if pts:
                any_data = True
                ax.plot(*zip(*pts), marker="o", label=policy)
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel("frames after the salient frame (k)")
        ax.set_ylabel("fraction of salient frames still in KV")
        ax.set_title(f"saliency retention ({setting})" + ("" if any_data else ": not exported by the runtime"))
        if any_data:
            ax.legend()
        ax.grid(alpha=0.3)
    paths.append(save_figure(fig, out / "saliency.png"))
    return paths



def write_report(results: dict[str, dict[str, dict]], out: Path, meta: dict[str, Any]) -> Path:
    lines = ["# Eviction-policy sweep", "",
             f"Clip: {meta['bag_description']}" + (f" (`{meta['bag']}`)" if meta.get("bag") else "")
             + f", replayed with the camera re-timed to "
             f"{meta['camera_hz']:g} Hz (JPEG decoded to rgb8), looped, {meta['duration']:g} s per run.",
             f"Machine: {meta['machine']}; backend: {meta['backend_used']}.", "",
             "Settings: " + "; ".join(f"**{s}** {json.dumps(SETTINGS[s]) if SETTINGS[s] else '(registry defaults)'}"
                                      for s in results), "",
             report_table(results), "",
             "Columns: *miss rate* = admitted chunks that overran the deadline / admitted; *fresh / fallback / hold* "
             "= share of the 30 Hz action ticks that carried a new action / repeated the last one / held; "
             "*frames dropped* = frames overwritten in the double buffer before inference took them (by design, "
             "the freshest frame wins); *salient kept @k* = salient frames still in the KV cache k admitted frames later "
             "(of those old enough to tell); "
             "*action MAE* = mean |runtime action - recorded action| (random weights: plumbing check only).", "",
             "Plots: `latency_cdf.png`, `rates.png`, `memory.png`, `saliency.png`.", "",
             "Reproduce:", "", "```", meta["command"], "```", ""]
    missing = [f"{s}/{p}" for s, by in results.items() for p, r in by.items()
               if r.get("saliency") is None and not r.get("error")]
    if missing:
        lines += ["Note: the runtime's stats carry no saliency report for " + ", ".join(missing) +
                  " (saliency retention shows n/a).", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path
