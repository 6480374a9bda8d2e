"""Where a process's threads spend their time, from py-spy's raw stacks (``py-spy record --threads --idle --format
raw``): per thread its share of the samples and its most frequent leaves, each the innermost Python frame plus the
native frame it was in (a wait on a condition variable under a Python call that released the GIL is a thread waiting
to get it back, or blocked in that call).

Why: the fleet replay's host part (decision to results minus the GPU's time) has a p99 of ~40 ms on the H200 while
its median is ~4 ms (docs/FIGURES.md, session 20); which thread holds the interpreter, and where the fleet loop's
thread waits, is what a profile of the edge answers (tools/h200_fleet_replay.sh ``PYSPY_S``).

    python -m vla_edge_ros.bench.stack_summary edge_pyspy.txt [--top 8]
"""
from __future__ import annotations

import argparse
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

_THREAD = re.compile(r"^thread \((?:0x)?[0-9a-fA-F]+\)(?::\s*(?P<name>.*))?$")
_PY_FRAME = re.compile(r"\([^()]*\.py:\d+\)$")


def parse(lines) -> dict[str, Counter]:
    """raw lines "thread (tid): name;frame;...;frame count" -> thread name -> Counter of leaf signatures. Lines
    that are not stacks (blank, comments, a malformed count) are skipped; a stack without a thread frame counts
    under "(process)"."""
    out: dict[str, Counter] = defaultdict(Counter)
    for line in lines:
        line = line.strip()
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread = "(process)"
        m = _THREAD.match(frames[0])
        if m:
            thread = (m.group("name") or frames[0]).strip() or frames[0]
            frames = frames[1:]
        out[thread][leaf(frames)] += int(count)
    return dict(out)


def leaf(frames: list[str]) -> str:
    """The innermost Python frame and, under it, the innermost named native one (bare addresses of stripped
    libraries skipped): "(native only) ..." for a thread with no Python frame, "(no frames)" for an empty stack."""
    py = next((i for i in range(len(frames) - 1, -1, -1) if _PY_FRAME.search(frames[i])), None)
    below = frames[py + 1:] if py is not None else frames
    named = [f for f in below if not f.startswith("0x")] or below
    native = named[-1] if named else ""
    if py is None:
        return f"(native only) {native}" if native else "(no frames)"
    return frames[py] + (f" -> {native}" if native else "")


def report(threads: dict[str, Counter], top: int = 8) -> str:
    total = sum(sum(c.values()) for c in threads.values())
    if not total:
        return "no samples"
    rows = [f"{total} samples over {len(threads)} threads"]
    for name, leaves in sorted(threads.items(), key=lambda kv: -sum(kv[1].values())):
        n = sum(leaves.values())
        rows.append(f"\n{name}: {n} samples ({100.0 * n / total:.1f} %)")
        for sig, k in leaves.most_common(top):
            rows.append(f"  {100.0 * k / n:5.1f} %  {sig}")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("raw", type=Path, help="py-spy record --format raw output")
    ap.add_argument("--top", type=int, default=8, help="leaves shown per thread")
    args = ap.parse_args(argv)
    if not args.raw.is_file():
        print(f"stack_summary: {args.raw} does not exist", file=sys.stderr)
        return 2
    print(report(parse(args.raw.read_text(errors="replace").splitlines()), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
