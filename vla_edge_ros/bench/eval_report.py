"""`vla_eval`'s outputs: the report.md table and the two plots, from the rows of bench/eval_grid.aggregate.

Why apart: rendering is pure text from rows (tested without ROS, test/test_eval_grid.py), and the plots are the
only matplotlib users of the eval (imported when drawn, Agg backend, so the eval also runs headless).
Failed settings stay in the table and in the plots' legends' place: a row says FAILED with its reason and log
directory instead of disappearing, so a grid that lost a point cannot pass for a complete one.
"""
from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from vla_edge_ros.bench.figures import save_figure


def _pct(v: Optional[float], digits: int = 0) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100.0 * v:.{digits}f}"


def _num(v: Optional[float], digits: int = 1) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{float(v):.{digits}f}"


def _sci(v: Optional[float]) -> str:
    """Three significant digits at any scale (jerk figures span orders of magnitude across rates)."""
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{float(v):.3g}"


def _load(values: Optional[Sequence[float]]) -> str:
    return "n/a" if not values else " / ".join(f"{v:.1f}" for v in values)


def _cell(text: Any) -> str:
    """A markdown table cell: a '|' in a label or an error message would split the row."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def table_row(r: Mapping[str, Any]) -> str:
    rt = r.get("runtime") or {}
    lat = rt.get("latency_ms") or {}
    chunks = rt.get("chunks") or {}
    sh = r.get("shares") or {}
    hold = None if sh.get("hold") is None else sh["hold"] + (sh.get("sim_hold") or 0.0)
    ci = r.get("success_ci95")
    success = f"{r['successes']}/{r['episodes']} = {_pct(r['success_rate'])} %" if r.get("episodes") else "n/a"
    status = "ok" if r.get("status") == "ok" else f"FAILED: {r.get('error')} (logs: `{r.get('logs')}`)"
    if rt:
        latency = f"{_num(lat.get('p50'))} / {_num(lat.get('p99'))}"
        misses = f"{chunks.get('deadline_misses', 'n/a')} ({_pct(rt.get('deadline_miss_rate'), 1)} %)"
        refused = f"{chunks.get('refused', 'n/a')} ({_pct(rt.get('refusal_rate'), 1)} %)"
        if rt.get("retried") is not None:
            refused += f", {rt['retried']} retried"
        frames = r.get("kv_frames")
        kv = f"{'?' if frames is None else frames} / {_num(rt.get('evictions_per_episode'))}"
    else:
        latency = misses = refused = kv = "-"
    cells = [r["label"], success, "n/a" if not ci else f"{_pct(ci[0])}-{_pct(ci[1])} %",
             _num((r.get("episode_s") or {}).get("mean")), _num(r.get("steps_mean")),
             f"{_pct(sh.get('fresh'))} / {_pct(sh.get('repeat'))} / {_pct(hold)}"
             + ("" if r.get("new_plan_share") is None else f" (new {_pct(r['new_plan_share'])})"),
             _sci(r.get("jerk_sq_mean")), latency, misses, refused, kv, status]
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


TABLE_HEAD = ("| setting | success | 95 % CI | episode s | steps | fresh / repeat / hold % of steps | jerk² (m/s³)² | "
              "chunk p50 / p99 ms | deadline misses | refused chunks | KV frames / evictions per episode | status |")


def render_table(rows: Sequence[Mapping[str, Any]]) -> str:
    lines = [TABLE_HEAD, "|" + "---|" * (TABLE_HEAD.count("|") - 1)]
    lines += [table_row(r) for r in rows]
    return "\n".join(lines)


def render_report(doc: Mapping[str, Any]) -> str:
    """report.md from the results.json document ({'meta': ..., 'rows': [...]})."""
    meta, rows = doc["meta"], doc["rows"]
    cfg = meta["config"]
    failed = [r for r in rows if r.get("status") != "ok"]
    lines = [
        "# Closed-loop evaluation (vla_eval)", "",
        f"{cfg['episodes']} episodes per setting from seeds {cfg['seed_start']}.."
        f"{cfg['seed_start'] + cfg['episodes'] - 1}"
        f" (the same initial states in every setting), horizon {cfg['horizon']} control steps; vla_sim at camera "
        f"{cfg['camera_hz']:g} Hz {cfg['image_width']}x{cfg['image_height']} px, control {cfg['control_hz']:g} Hz"
        f"{' (camera rendered right after the control steps)' if cfg.get('camera_after_control') else ''}, in "
        "wall-clock time (the sim never waits for the policy). Model settings: `vla_runtime --role all` (real ROS 2 "
        "processes, a fresh ROS_DOMAIN_ID per setting) against `vla_sim`; baselines: `vla_sim` alone with "
        "`sim_policy` expert / hold (same mapping and control timing, no runtime).",
        f"Checkpoint: {cfg['checkpoint'] or 'none (the embedded random-weight default)'}. "
        f"Machine: {meta['machine']}; load average (1 / 5 / 15 min) at start {_load(meta.get('load_avg_at_start'))}, "
        f"at the end {_load(meta.get('load_avg_now'))} (the runtime's chunk figures and refusals depend on it). "
        f"Wall time: {_num(meta.get('wall_s'), 0)} s.", "",
        render_table(rows), "",
        "Columns: *success* with a 95 % Wilson score interval; *episode s* = mean wall-clock episode time (to success "
        "or horizon); *fresh / repeat / hold* = share of the sim's control steps that applied a fresh action, a "
        "repeat of the last one, or held (hold includes the sim's own holds: no action yet, stale, rejected); "
        "*(new)* = steps whose action came from a newer camera frame than the step before (a publisher faster than "
        "the control steps sends most new actions as repeats); *jerk²* = mean squared jerk of the commanded end-effector trajectory (sim/episode.py; lower is smoother); "
        "*chunk p50 / p99*, *deadline misses* (admitted chunks that overran the deadline) and *refused chunks* "
        "(admission refused: the deadline could not be met) are the runtime's own figures (`--stats-out`) over the "
        "whole run; *KV frames* = frames the KV budget keeps after the instruction prefix, *evictions per episode* "
        "= the KV manager's evictions / episodes. Injected latency: `VLA_FAULT_INJECT=hang:<ms>@1+` on the runtime "
        "(every live chunk sleeps that long, then runs).", "",
        "Plots: `success_vs_latency.png` (success vs injected latency per eviction policy), `success_by_setting.png`.",
        "", "Reproduce:", "", "```", meta["command"], "```", ""]
    if failed:
        lines += [f"{len(failed)} setting(s) FAILED (kept in the table with their reasons and logs).", ""]
    return "\n".join(lines)


def make_plots(rows: Sequence[Mapping[str, Any]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    paths = []
    tasks = list(dict.fromkeys(r["setting"]["task"] for r in rows))
    fig, axes = plt.subplots(1, len(tasks), figsize=(6.5 * len(tasks), 4.5), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        groups: dict[tuple, list] = {}
        for r in rows:
            s = r["setting"]
            if s["task"] != task or s["kind"] != "model" or r.get("success_rate") is None:
                continue
            key = (s["eviction_policy"], s["kv_budget_tokens"], s["deadline_ms"], s["backend"], bool(s["checkpoint"]))
            groups.setdefault(key, []).append(r)
        for (policy, budget, deadline, backend, ckpt), rs in groups.items():
            rs = sorted(rs, key=lambda r: r["setting"]["inject_ms"])
            x = [r["setting"]["inject_ms"] for r in rs]
            y = [r["success_rate"] for r in rs]
            err = [[r["success_rate"] - r["success_ci95"][0] for r in rs],
                   [r["success_ci95"][1] - r["success_rate"] for r in rs]]
            label = (f"{policy}, kv {budget or 'default'}, {deadline:g} ms, {backend}"
                     + ("" if ckpt else ", random weights"))
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=label)
        for r in rows:
            s = r["setting"]
            if s["task"] == task and s["kind"] in ("expert", "hold") and r.get("success_rate") is not None:
                ax.axhline(r["success_rate"], ls="--" if s["kind"] == "expert" else ":", color="k",
                           lw=1, label=f"{s['kind']} baseline")
        xmax = max([r["setting"]["inject_ms"] for rs in groups.values() for r in rs] + [0.0])
        ax.set_xlim(-5.0, max(xmax, 100.0) + 5.0)  # 0..100 ms at least: a lone 0 ms point is not a trend
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel("injected extra chunk latency (ms)")
        ax.set_ylabel("success rate (95 % Wilson interval)")
        ax.set_title(f"{task}: success vs injected latency")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    paths.append(save_figure(fig, out / "success_vs_latency.png"))

    fig, ax = plt.subplots(figsize=(11, 0.6 * len(rows) + 1.5))
    ys = list(range(len(rows)))[::-1]
    for y, r in zip(ys, rows):
        if r.get("success_rate") is None:
            ax.text(0.01, y, "no episodes (FAILED)", va="center", color="r", fontsize=8)
            continue
        lo, hi = r["success_ci95"]
        color = "r" if r.get("status") != "ok" else "C0"
        ax.errorbar([r["success_rate"]], [y], xerr=[[r["success_rate"] - lo], [hi - r["success_rate"]]], fmt="o",
                    capsize=3, color=color)
    ax.set_yticks(ys, [textwrap.fill(r["label"] + (" [FAILED]" if r.get("status") != "ok" else ""), 48)
                       for r in rows], fontsize=7)
    ax.set_xlim(-0.05, 1.05)
    ax.set_xlabel("success rate (95 % Wilson interval)")
    ax.set_title("success per setting")
    ax.grid(axis="x", alpha=0.3)
    paths.append(save_figure(fig, out / "success_by_setting.png"))
    return paths

