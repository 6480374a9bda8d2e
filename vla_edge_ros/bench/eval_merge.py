"""One table from several `vla_eval` runs: the same setting split over seed ranges and run side by side.

    python -m vla_edge_ros.bench.eval_merge OUT RUN_DIR [RUN_DIR ...]

Why: `vla_eval` runs its settings one after another in wall-clock time (tens of seconds per episode), while a
many-core GPU machine can run several sims and runtimes at once, each in its own ROS domain
(tools/h200_eval.sh). A run directory is a `vla_eval --out` folder; its name is ``<group>.s<seed_start>``: the runs
of one group (e.g. ``cuda-int8-push``) are the same setting over disjoint seeds, so their episodes add up. Per
group and row of results.json (one row per setting): successes / episodes summed, the Wilson 95 % interval of the
sum, mean episode time, the share of control steps that applied an action computed from a newer frame than the
step before (the eval's "new", weighted by steps), chunk latency p50 / p99 (the worst run's: percentiles do not
add), admitted chunks and deadline misses summed. A run whose results.json is missing or whose row failed is
listed as FAILED with its reason, never dropped; the exit code is then 1. Writes OUT/merged.json and
OUT/merged.md and prints the table.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from vla_edge_ros.bench.eval_grid import wilson_interval

RUN_NAME = re.compile(r"^(?P<group>.+)\.s(?P<seed>\d+)$")


def group_of(run_dir: Path) -> str:
    """``cuda-int8-push.s25`` -> ``cuda-int8-push``; a name without the seed suffix is its own group."""
    m = RUN_NAME.match(run_dir.name)
    return m.group("group") if m else run_dir.name


def _sum(values: Sequence[Optional[float]]) -> Optional[float]:
    vals = [v for v in values if v is not None]
    return float(sum(vals)) if vals else None


def _max(values: Sequence[Optional[float]]) -> Optional[float]:
    vals = [v for v in values if v is not None]
    return float(max(vals)) if vals else None


def weighted_mean(parts: Sequence[tuple[Optional[float], float]]) -> Optional[float]:
    """Mean of the values weighted by the second member of each pair; None values and zero weights left out,
    None when nothing is left."""
    kept = [(v, w) for v, w in parts if v is not None and w > 0]
    total = sum(w for _, w in kept)
    return sum(v * w for v, w in kept) / total if total else None


def merge_rows(group: str, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The summed figures of one group's rows (the same setting, disjoint seeds)."""
    episodes = sum(int(r.get("episodes") or 0) for r in rows)
    successes = sum(int(r.get("successes") or 0) for r in rows)
    steps = [float(r.get("steps_mean") or 0.0) * int(r.get("episodes") or 0) for r in rows]
    chunks = [(r.get("runtime") or {}).get("chunks") or {} for r in rows]
    lat = [(r.get("runtime") or {}).get("latency_ms") or {} for r in rows]
    setting = rows[0].get("setting") or {}
    return {
        "group": group, "task": setting.get("task"), "backend": setting.get("backend"), "runs": len(rows),
        "episodes": episodes, "successes": successes,
        "success_rate": successes / episodes if episodes else None,
        "success_ci95": list(wilson_interval(successes, episodes)) if episodes else None,
        "episode_s_mean": weighted_mean([((r.get("episode_s") or {}).get("mean"), int(r.get("episodes") or 0))
                                         for r in rows]),
        "new_frame_share": weighted_mean([(r.get("new_plan_share"), n) for r, n in zip(rows, steps)]),
        "chunks_admitted": _sum([c.get("admitted") for c in chunks]),
        "chunks_refused": _sum([c.get("refused") for c in chunks]),
        "deadline_misses": _sum([c.get("deadline_misses") for c in chunks]),
        "latency_p50_ms_max": _max([x.get("p50") for x in lat]),
        "latency_p99_ms_max": _max([x.get("p99") for x in lat]),
    }


def collect(run_dirs: Sequence[Path]) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """(merged rows, failures): rows grouped by (group, row index of results.json)."""
    by_key: dict[tuple[str, int], list[Mapping[str, Any]]] = defaultdict(list)
    failures: list[dict[str, str]] = []
    for run in run_dirs:
        path = Path(run) / "results.json"
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            failures.append({"run": str(run), "reason": f"no readable results.json ({exc})"})
            continue
        for i, row in enumerate(doc.get("rows") or []):
            if row.get("status") != "ok":
                failures.append({"run": str(run), "reason": f"row {i} {row.get('status')}: {row.get('error')}"})
                continue
            by_key[(group_of(Path(run)), i)].append(row)
        if not doc.get("rows"):
            failures.append({"run": str(run), "reason": "results.json has no rows"})
    return [merge_rows(g, rows) for (g, _), rows in sorted(by_key.items())], failures


def _f(v: Optional[float], fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


def render(rows: Sequence[Mapping[str, Any]], failures: Sequence[Mapping[str, str]]) -> str:
    lines = ["| group | task | backend | success | 95 % CI | episode s | new-frame steps | chunk p50 / p99 ms (worst run) | "
             "admitted | misses |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ci = r["success_ci95"]
        lines.append(
            f"| {r['group']} | {r['task']} | {r['backend']} | {r['successes']}/{r['episodes']} "
            f"({_f(r['success_rate'] and 100 * r['success_rate'], '.0f')} %) | "
            f"{'n/a' if ci is None else f'{100 * ci[0]:.0f}-{100 * ci[1]:.0f} %'} | {_f(r['episode_s_mean'], '.1f')} | "
            f"{_f(r['new_frame_share'] and 100 * r['new_frame_share'], '.1f')} % | {_f(r['latency_p50_ms_max'], '.1f')} / "
            f"{_f(r['latency_p99_ms_max'], '.1f')} | {_f(r['chunks_admitted'], '.0f')} | "
            f"{_f(r['deadline_misses'], '.0f')} |")
    for f in failures:
        lines.append(f"| FAILED: {f['run']} | {f['reason']} | | | | | | | | |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="vla_eval_merge", description=__doc__.split("\n")[0])
    ap.add_argument("out", help="folder for merged.json / merged.md")
    ap.add_argument("runs", nargs="+", help="vla_eval --out folders named <group>.s<seed_start>")
    args = ap.parse_args(argv)
    rows, failures = collect([Path(r) for r in args.runs])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "merged.json").write_text(json.dumps({"rows": rows, "failures": failures, "runs": args.runs}, indent=2))
    table = render(rows, failures)
    (out / "merged.md").write_text(table)
    print(table, end="")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
