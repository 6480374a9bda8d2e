"""Generate config/runtime.yaml and the README parameter table from the registry (vla_edge_ros/params.py).

    python -m vla_edge_ros.ros.param_docs --write   # rewrite config/runtime.yaml and the README table
    python -m vla_edge_ros.ros.param_docs --check   # exit 1 when either differs from the registry

test/test_params_registry.py runs the check, so the registry, the YAML and the README cannot drift.
No rclpy import: pure text generation.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vla_edge_ros import params as P

ROOT = Path(__file__).resolve().parents[2]
YAML_PATH = ROOT / "config" / "runtime.yaml"
README_PATH = ROOT / "README.md"
BEGIN = "<!-- BEGIN PARAMETER TABLE (generated: python -m vla_edge_ros.ros.param_docs --write) -->"
END = "<!-- END PARAMETER TABLE -->"


def _yaml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace('"', '\\"') + '"'


def _range(s: P.ParamSpec) -> str:
    if s.choices:
        return " \\| ".join(s.choices)
    if s.min is None and s.max is None:
        return ""
    lo = "-inf" if s.min is None else f"{s.min:.10g}"
    hi = "inf" if s.max is None else f"{s.max:.10g}"
    return f"[{lo}, {hi}]"


def yaml_text() -> str:
    out = [
        "# ROS 2 parameters of the vla_edge_ros runtime, one section per node.",
        "# Generated from vla_edge_ros/params.py (python -m vla_edge_ros.ros.param_docs --write); a test checks it.",
        "# Durations are milliseconds as doubles. 'live' parameters can be changed with `ros2 param set`.",
        "# Use: ros2 launch vla_edge_ros runtime.launch.py params_file:=<this file>",
        "#  or: vla_runtime --ros-args --params-file config/runtime.yaml",
    ]
    for node in P.NODES:
        out += [f"{node}:", "  ros__parameters:"]
        for s in P.for_node(node):
            note = [x for x in (_range(s).replace("\\|", "|"), "live" if s.live else "read-only") if x]
            out.append(f"    {s.name}: {_yaml_value(s.default)}  # {'; '.join(note)}")
    return "\n".join(out) + "\n"


def readme_table() -> str:
    rows = ["| node | parameter | type | default | range / choices | live (applies) | description |",
            "|---|---|---|---|---|---|---|"]
    for s in P.PARAMS:
        default = f"`{s.default!r}`" if not isinstance(s.default, str) else f"`\"{s.default}\"`"
        live = f"yes ({s.applies})" if s.live else "no"
        desc = s.description.replace("|", "\\|")
        rows.append(f"| {s.node} | `{s.name}` | {s.type.__name__} | {default} | {_range(s)} | {live} | {desc} |")
    return "\n".join(rows) + "\n"


def readme_with_table(text: str) -> str:
    if BEGIN not in text or END not in text:
        raise ValueError(f"README has no parameter table markers ({BEGIN!r} ... {END!r})")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + BEGIN + "\n" + readme_table() + END + tail


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", action="store_true")
    g.add_argument("--check", action="store_true")
    a = ap.parse_args(argv)
    want_yaml = yaml_text()
    want_readme = readme_with_table(README_PATH.read_text(encoding="utf-8"))
    if a.write:
        YAML_PATH.write_text(want_yaml, encoding="utf-8")
        README_PATH.write_text(want_readme, encoding="utf-8")
        return 0
    bad = [str(p) for p, want in ((YAML_PATH, want_yaml), (README_PATH, want_readme))
           if p.read_text(encoding="utf-8") != want]
    if bad:
        print("out of date with vla_edge_ros/params.py: " + ", ".join(bad) +
              " (run python -m vla_edge_ros.ros.param_docs --write)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
