"""Issue 22's comparison of execution schemes in closed loop: success and smoothness vs injected chunk latency.

Why a script of its own: `vla_eval` (bench/eval.py) takes one checkpoint and one set of runtime parameters per
run, while the comparison is five schemes, two checkpoints (a single-step policy and an H-step chunk policy of
the same recipe) and several latencies, reported side by side in ONE table and ONE plot. Each scheme is one
`vla_eval` run (real ROS 2 processes, wall-clock time, the same seeds in every setting), so every figure below
is the runtime's, not a model of it:

| scheme | checkpoint | runtime parameters |
| --- | --- | --- |
| single_step | the H = 1 policy | (one action per chunk: fresh, repeat, hold) |
| sync_chunks | the H-step policy | execution_horizon_steps = H (a chunk is played to its end, then the next) |
| async_latest | the H-step policy | execution_horizon_steps 0 (= ceil(H / 2)), chunk_merge latest |
| async_temporal_ensemble | the H-step policy | the same, chunk_merge temporal_ensemble (ACT) |
| async_blend | the H-step policy | the same, chunk_merge blend + force_committed_steps (RTC-like) |
| async_receding | the H-step policy | execution_horizon_steps 1, chunk_merge latest: a new chunk after every step |

The first five are the issue's comparison and the default. ``async_receding`` (receding-horizon control, as model
predictive control replans) asks whether chunks help through their latency compensation alone: every tick
may bring a chunk of a newer frame (one at a time: a chunk longer than a step makes them rarer), whose due
step replaces what single-step would repeat, so it reacts as often as single-step and predicts where that repeats.

A scheme name may carry ``+<modifier>`` suffixes, each a runtime parameter of that scheme's runs, into a folder
of the whole name, so that the variants sit in one table: a readout (``async_latest+expectation``: the runtime's
``action_readout``, engine/geometry.py: the argmax bin's centre, the default, or the mean of the bin centres under
each slot's softmax) and a weight type (``single_step+int4``: ``weight_dtype``, issue 23's closed-loop comparison of
quantised weights; docs/QUANTIZATION.md), at most one of each (``async_latest+int8+expectation``).

Latency is injected through the runtime's fault hook (`VLA_FAULT_INJECT=hang:<ms>@1+`: every chunk sleeps that
long, then runs). The deadline is one value for every scheme (``--deadline``, default 400 ms: two 5 Hz steps),
so that a single-step policy slowed by the injection is admitted and acts late rather than being refused
outright; chunk schemes with overlap get the executing chunk's run-out as their deadline (core/chunk_schedule.py).

``--jobs N`` (a many-core machine, e.g. the GPU machine with ``--backend cuda``): every (scheme, latency) cell is its
own `vla_eval` run into ``<out>/<scheme>/inj<ms>/``, at most N at a time, each in its own ROS domain; the table
reads the cells back in latency order. Default 1: one `vla_eval` per scheme, one after another. ``--splits K`` (with
--jobs) also splits each cell's episodes into K seed ranges run side by side (``inj<ms>.s<seed>/``; a cell's
episodes are sequential in wall-clock time, so this is what bounds the run): their episodes add up into the
cell's row (``merge_cell``).

Outputs under ``--out``: one `vla_eval` directory per scheme, ``compare.json``, ``compare.md`` (the table) and
``compare.png`` (success and mean squared jerk vs injected latency, one line per scheme).
``--report-only`` rebuilds the table and plot from the scheme directories already there.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

SCHEMES: dict[str, dict[str, Any]] = {
    "single_step": {"chunk": False, "params": []},
    "sync_chunks": {"chunk": True, "params": ["execution_horizon_steps:={H}", "chunk_merge:=latest"]},
    "async_latest": {"chunk": True, "params": ["execution_horizon_steps:=0", "chunk_merge:=latest"]},
    "async_temporal_ensemble": {"chunk": True, "params": ["execution_horizon_steps:=0",
                                                          "chunk_merge:=temporal_ensemble"]},
    "async_blend": {"chunk": True, "params": ["execution_horizon_steps:=0", "chunk_merge:=blend",
                                              "force_committed_steps:=true"]},
    "async_receding": {"chunk": True, "params": ["execution_horizon_steps:=1", "chunk_merge:=latest"]},
}
DEFAULT_SCHEMES = ("single_step", "sync_chunks", "async_latest", "async_temporal_ensemble", "async_blend")


def split_scheme(name: str) -> tuple[str, dict[str, str]]:
    """``scheme[+modifier...]`` -> (scheme, {runtime parameter: value}); ValueError naming what is unknown or
    given twice."""
    from vla_edge_ros.params import ACTION_READOUTS, WEIGHT_DTYPES

    base, *mods = name.split("+")
    if base not in SCHEMES:
        raise ValueError(f"unknown scheme {base!r} (one of {', '.join(SCHEMES)})")
    # a suffix value -> the runtime parameter it sets (a value names its parameter: the two sets are disjoint)
    choices = {**{v: "action_readout" for v in ACTION_READOUTS}, **{v: "weight_dtype" for v in WEIGHT_DTYPES}}
    chosen: dict[str, str] = {}
    for m in mods:
        if m not in choices:
            raise ValueError(f"unknown modifier {m!r} in {name!r} (a readout or weight type: {', '.join(choices)})")
        if choices[m] in chosen:
            raise ValueError(f"{name!r} sets {choices[m]} twice")
        chosen[choices[m]] = m
    return base, chosen


def horizon_of(checkpoint: str) -> int:
    from vla_edge_ros.engine import shipped

    cfg = json.loads((Path(shipped.resolve(checkpoint)) / "config.json").read_text())
    return int(cfg.get("vla", {}).get("action_horizon", 1))


def eval_command(scheme: str, args: argparse.Namespace, out: Path, domain_id: int,
                 latencies: Optional[str] = None, seeds: Optional[tuple[int, int]] = None) -> list[str]:
    """The `vla_eval` command of one scheme, over ``latencies`` (default: all of --latencies) into ``out``;
    ``seeds`` (first seed, episodes) is one split of the cell (default: --seed-start, --episodes)."""
    base, modifiers = split_scheme(scheme)
    spec = SCHEMES[base]
    ckpt = args.chunk_checkpoint if spec["chunk"] else args.single_checkpoint
    if not ckpt:
        raise ValueError(f"{scheme} needs " + ("--chunk-checkpoint (an H-step policy)" if spec["chunk"]
                                               else "--single-checkpoint (an H = 1 policy)"))
    h = horizon_of(ckpt)
    if spec["chunk"] != (h > 1):
        raise ValueError(f"{scheme} needs a {'chunk (H > 1)' if spec['chunk'] else 'single-step (H = 1)'} "
                         f"checkpoint; {ckpt} has action_horizon {h}")
    seed_start, episodes = seeds or (args.seed_start, args.episodes)
    cmd = [sys.executable, "-m", "vla_edge_ros.bench.eval", "--checkpoint", ckpt, "--tasks", args.task,
           "--episodes", str(episodes), "--policies", "sliding_window", "--kv-budgets", "0",
           "--deadlines", f"{args.deadline:g}", "--latencies", latencies or args.latencies,
           "--backends", args.backend, "--camera-hz", f"{args.hz:g}",
           "--control-hz", f"{args.hz:g}", "--image-wh", "128", "64", "--seed-start", str(seed_start),
           "--camera-after-control", "--runtime-param", "window_frames:=2", "--baselines", "none",
           "--domain-id", str(domain_id), "--out", str(out)]
    for p in spec["params"] + [f"{name}:={value}" for name, value in modifiers.items()]:
        cmd += ["--runtime-param", p.format(H=h)]
    if not args.progress:
        cmd.append("--no-progress")
    return cmd


def seed_splits(seed_start: int, episodes: int, splits: int) -> list[tuple[int, int]]:
    """``episodes`` seeds from ``seed_start`` in at most ``splits`` consecutive ranges: (first seed, count)."""
    per = -(-episodes // max(1, splits))
    return [(seed_start + k, min(per, episodes - k)) for k in range(0, episodes, per)]


def cells(args: argparse.Namespace, schemes: Sequence[str], out: Path) -> list[list[str]]:
    """The `vla_eval` commands to run: one per scheme (jobs 1), or one per (scheme, latency) cell and seed range,
    each in its own folder and ROS domain (ids from --domain-id up, one per command; at most 10 latencies)."""
    lats = [x.strip() for x in args.latencies.split(",") if x.strip()]
    if args.splits < 1:
        raise ValueError(f"--splits must be >= 1, got {args.splits}")
    if args.jobs <= 1:
        if args.splits > 1:
            raise ValueError("--splits needs --jobs > 1 (the ranges of a cell run side by side)")
        return [eval_command(s, args, out / s, args.domain_id + 10 * i) for i, s in enumerate(schemes)]
    if len(lats) > 10:
        raise ValueError(f"--jobs > 1 takes at most 10 latencies, got {len(lats)}")
    ranges = seed_splits(args.seed_start, args.episodes, args.splits)
    runs = [(s, lat, r) for s in schemes for lat in lats for r in ranges]
    if args.domain_id + len(runs) - 1 > 232:
        raise ValueError(f"{len(runs)} runs from --domain-id {args.domain_id} pass ROS's last domain id 232")
    tag = (lambda r: f".s{r[0]}") if len(ranges) > 1 else (lambda r: "")
    return [eval_command(s, args, out / s / f"inj{float(lat):g}{tag(r)}", args.domain_id + n, latencies=lat, seeds=r)
            for n, (s, lat, r) in enumerate(runs)]


def run_cells(cmds: list[list[str]], jobs: int, t0: float) -> None:
    """Run the commands, at most ``jobs`` at a time; a failed one is reported (its results.json row says why)."""
    running: list[tuple[subprocess.Popen, list[str]]] = []
    pending = list(cmds)
    while pending or running:
        while pending and len(running) < max(1, jobs):
            cmd = pending.pop(0)
            print(f"[chunk_compare t={time.monotonic() - t0:.0f}s] start {cmd[cmd.index('--out') + 1]}", flush=True)
            running.append((subprocess.Popen(cmd), cmd))
        time.sleep(0.5)
        for proc, cmd in list(running):
            if proc.poll() is not None:
                running.remove((proc, cmd))
                tag = cmd[cmd.index("--out") + 1]
                print(f"[chunk_compare t={time.monotonic() - t0:.0f}s] done {tag} (exit {proc.returncode})"
                      f"{'' if proc.returncode == 0 else ': its row says why'}", flush=True)


def _result_files(out: Path, scheme: str) -> list[Path]:
    """A scheme's results.json: one for the scheme, or one per latency cell (--jobs > 1)."""
    whole = out / scheme / "results.json"
    return [whole] if whole.exists() else sorted((out / scheme).glob("inj*/results.json"))


def collect(out: Path, schemes: Sequence[str]) -> list[dict[str, Any]]:
    """One record per (scheme, latency) from the schemes' results.json; a missing or failed one is kept as such."""
    rows = []
    for scheme in schemes:
        paths = _result_files(out, scheme)
        if not paths:
            rows.append({"scheme": scheme, "inject_ms": None, "status": "missing",
                         "error": f"no {out / scheme / 'results.json'}"})
            continue
        found = [r for path in paths for r in json.loads(path.read_text())["rows"]]
        by_latency: dict[float, list[dict[str, Any]]] = {}
        for r in found:
            by_latency.setdefault(r["setting"]["inject_ms"], []).append(r)
        rows += [merge_cell(scheme, by_latency[lat]) for lat in sorted(by_latency)]
    return rows


def _record(scheme: str, r: dict[str, Any]) -> dict[str, Any]:
    """The table's record of one results.json row."""
    rt = r.get("runtime") or {}
    return {"scheme": scheme, "inject_ms": r["setting"]["inject_ms"], "status": r["status"],
            "error": r.get("error"), "episodes": r.get("episodes", 0), "successes": r.get("successes", 0),
            "success_rate": r.get("success_rate"), "ci95": r.get("success_ci95"),
            "jerk_sq_mean": r.get("jerk_sq_mean"), "shares": r.get("shares"),
            "new_plan_share": r.get("new_plan_share"), "success_steps_mean": r.get("success_steps_mean"),
            "chunk_ms": rt.get("latency_ms"), "chunks": rt.get("chunks")}


def merge_cell(scheme: str, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One cell's record from its seed ranges' rows (--splits). What every split run adds up the same way
    (episodes, successes and the Wilson interval of the sum, the worst range's chunk latency: percentiles do not
    add, chunk counts) is bench/eval_merge.py's ``merge_rows``; on top: jerk the episode-weighted mean, the shares
    of control steps step-weighted (episodes x mean steps), steps to success success-weighted. A failed range fails
    the cell, with its reason."""
    parts = [_record(scheme, r) for r in rows]
    if len(parts) == 1:
        return parts[0]
    failed = [p for p in parts if p["status"] != "ok"]
    if failed:
        return {**failed[0], "error": f"{len(failed)} of {len(parts)} seed ranges failed: {failed[0]['error']}"}
    from vla_edge_ros.bench.eval_merge import merge_rows, weighted_mean

    m = merge_rows(scheme, rows)
    steps = [p["episodes"] * (r.get("steps_mean") or 1.0) for p, r in zip(parts, rows)]
    shares = {k: weighted_mean([((p["shares"] or {}).get(k), w) for p, w in zip(parts, steps)])
              for k in dict.fromkeys(k for p in parts for k in (p["shares"] or {}))}
    return {**parts[0], "episodes": m["episodes"], "successes": m["successes"], "success_rate": m["success_rate"],
            "ci95": m["success_ci95"],
            "jerk_sq_mean": weighted_mean([(p["jerk_sq_mean"], p["episodes"]) for p in parts]),
            "success_steps_mean": weighted_mean([(p["success_steps_mean"], p["successes"]) for p in parts]),
            "shares": shares, "new_plan_share": weighted_mean([(p["new_plan_share"], w) for p, w in zip(parts, steps)]),
            "chunk_ms": {"p50": m["latency_p50_ms_max"] or 0.0, "p99": m["latency_p99_ms_max"] or 0.0},
            "chunks": {"admitted": int(m["chunks_admitted"] or 0), "refused": int(m["chunks_refused"] or 0),
                       "deadline_misses": int(m["deadline_misses"] or 0)},
            "seed_ranges": len(parts)}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| scheme | injected ms | success | 95 % CI | jerk² (m/s³)² | steps to success | fresh / repeat / hold % "
             "| chunk p50 / p99 ms | admitted / refused / late |", "|" + "---|" * 9]
    # "(new N)": the share of control steps whose action came from a newer camera frame than the step before
    # (vla_eval's new_plan_share): single-step at a control rate below the publisher's shows "fresh 0 %" because
    # the sim counts an action the 30 Hz publisher already sent as a repeat, yet every step may be a new plan
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['scheme']} | {r['inject_ms']} | {r['status'].upper()}: {r['error']} |" + " |" * 6)
            continue
        sh, ch, ck = r["shares"] or {}, r["chunk_ms"] or {}, r["chunks"] or {}
        lo, hi = r["ci95"] or (0.0, 0.0)
        lines.append(
            f"| {r['scheme']} | {r['inject_ms']:g} | {r['successes']}/{r['episodes']} = {100 * r['success_rate']:.0f} % "
            f"| {100 * lo:.0f}-{100 * hi:.0f} % | {r['jerk_sq_mean']:.3g} | {r['success_steps_mean'] or 0:.0f} "
            f"| {100 * sh.get('fresh', 0):.0f} / {100 * sh.get('repeat', 0):.0f} / {100 * sh.get('hold', 0):.0f}"
            + ("" if r.get("new_plan_share") is None else f" (new {100 * r['new_plan_share']:.0f})")
            + f" | {ch.get('p50', 0):.0f} / {ch.get('p99', 0):.0f} "
            f"| {ck.get('admitted', 0)} / {ck.get('refused', 0)} / {ck.get('deadline_misses', 0)} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> Optional[Path]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for scheme in dict.fromkeys(r["scheme"] for r in rows):
        pts = sorted((r["inject_ms"], r) for r in rows if r["scheme"] == scheme and r["status"] == "ok")
        if not pts:
            continue
        xs = [x for x, _ in pts]
        a1.errorbar(xs, [100 * r["success_rate"] for _, r in pts], marker="o", capsize=3, label=scheme,
                    yerr=[[100 * (r["success_rate"] - r["ci95"][0]) for _, r in pts],
                          [100 * (r["ci95"][1] - r["success_rate"]) for _, r in pts]])
        a2.plot(xs, [r["jerk_sq_mean"] for _, r in pts], marker="o", label=scheme)
    a1.set(xlabel="injected chunk latency (ms)", ylabel="success (%)", ylim=(-5, 105), title="task success (95 % CI)")
    a2.set(xlabel="injected chunk latency (ms)", ylabel="mean squared jerk (m/s³)²", title="commanded jerk")
    a2.set_yscale("log")
    a1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--single-checkpoint", default="metaworld_mt3", help="the H = 1 policy (a path or shipped name)")
    ap.add_argument("--chunk-checkpoint", default="metaworld_mt3_p4",
                    help="the H-step policy of the same recipe (a path or shipped name; every scheme but single_step)")
    ap.add_argument("--schemes", default=",".join(DEFAULT_SCHEMES),
                    help=f"comma list of {', '.join(SCHEMES)}, each optionally +argmax / +expectation "
                         "and +bf16 / +int8 / +fp8 / +int4")
    ap.add_argument("--task", default="push")
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--latencies", default="0,200", help="injected chunk latency, ms, comma list")
    ap.add_argument("--deadline", type=float, default=400.0)
    ap.add_argument("--hz", type=float, default=5.0, help="camera = control rate (the CPU deploy rate)")
    ap.add_argument("--seed-start", type=int, default=0)
    ap.add_argument("--domain-id", type=int, default=120,
                    help="first ROS_DOMAIN_ID (one after another: +10 per scheme; --jobs: +1 per run)")
    ap.add_argument("--backend", default="numpy", choices=["numpy", "cuda"], help="engine of every scheme")
    ap.add_argument("--jobs", type=int, default=1, help="cells run side by side (module docstring)")
    ap.add_argument("--splits", type=int, default=1, help="seed ranges per cell, side by side (with --jobs)")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    ap.add_argument("--out", default="results/chunk_compare")
    return ap.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    out = Path(args.out)
    try:  # every command is built (names, checkpoints, horizons) before anything is written or run
        for s in schemes:
            split_scheme(s)
        cmds = [] if args.report_only else cells(args, schemes, out)
    except ValueError as exc:
        print(f"chunk_compare: {exc}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    if not args.report_only:
        for cmd in cmds:
            print(f"[chunk_compare] {' '.join(cmd[2:])}", flush=True)
        run_cells(cmds, args.jobs, t0)
    rows = collect(out, schemes)
    md = table(rows)
    (out / "compare.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    reproduce = " ".join(["python -m vla_edge_ros.bench.chunk_compare", *(argv if argv is not None else sys.argv[1:])])
    (out / "compare.md").write_text(f"# Execution schemes, closed loop ({args.task}, {args.hz:g} Hz, deadline "
                                    f"{args.deadline:g} ms, backend {args.backend})\n\n{md}\n\n"
                                    f"Reproduce: `{reproduce}`\n")
    png = plot(rows, out / "compare.png")
    print(md)
    print(f"chunk_compare: wrote {out / 'compare.md'}, {out / 'compare.json'}"
          f"{', ' + str(png) if png else ''} in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
