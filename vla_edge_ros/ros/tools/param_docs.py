"""Generate config/runtime.yaml and the parameter tables of the docs from the registry (vla_edge_ros/params.py).

    python -m vla_edge_ros.ros.tools.param_docs --write   # rewrite config/runtime.yaml and every doc table
    python -m vla_edge_ros.ros.tools.param_docs --check   # exit 1 when any of them differs from the registry

Where each node's table goes (DOC_TABLES): the runtime nodes' (vla_camera, vla_inference, vla_action) into the
README, which a newcomer reads first and which must stay short; the simulated arm's (vla_sim) into docs/SIM.md,
beside the closed loop it belongs to. Every node of the registry is in exactly one of them (checked at import).
test/test_params_registry.py runs the check, so the registry, the YAML and the docs cannot drift.
No rclpy import: pure text generation.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vla_edge_ros import params as P

ROOT = Path(__file__).resolve().parents[3]
YAML_PATH = ROOT / "config" / "runtime.yaml"
README_PATH = ROOT / "README.md"
SIM_DOC_PATH = ROOT / "docs" / "SIM.md"
RUNTIME_NODES = (P.CAMERA, P.INFERENCE, P.ACTION)
DOC_TABLES = {README_PATH: RUNTIME_NODES, SIM_DOC_PATH: (P.SIM,)}  # doc -> the nodes whose table it carries
BEGIN = "<!-- BEGIN PARAMETER TABLE (generated: python -m vla_edge_ros.ros.tools.param_docs --write) -->"
END = "<!-- END PARAMETER TABLE -->"

_placed = [n for nodes in DOC_TABLES.values() for n in nodes]
if sorted(_placed) != sorted(P.NODES):  # a new node must be given a doc, and no node two
    raise RuntimeError(f"param_docs.DOC_TABLES places nodes {sorted(_placed)}, the registry has {sorted(P.NODES)}")


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
        "# Generated from vla_edge_ros/params.py (python -m vla_edge_ros.ros.tools.param_docs --write); a test checks it.",
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


def doc_table(nodes=RUNTIME_NODES) -> str:
    """The markdown table of the given nodes' parameters, in registry order."""
    rows = ["| node | parameter | type | default | range / choices | live (applies) | description |",
            "|---|---|---|---|---|---|---|"]
    for s in (s for s in P.PARAMS if s.node in nodes):
        default = f"`{s.default!r}`" if not isinstance(s.default, str) else f"`\"{s.default}\"`"
        live = f"yes ({s.applies})" if s.live else "no"
        desc = s.description.replace("|", "\\|")
        rows.append(f"| {s.node} | `{s.name}` | {s.type.__name__} | {default} | {_range(s)} | {live} | {desc} |")
    return "\n".join(rows) + "\n"


def with_table(text: str, nodes=RUNTIME_NODES, where: str = "README.md") -> str:
    """``text`` with the part between the markers replaced by the nodes' generated table."""
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"{where} needs exactly one pair of parameter table markers ({BEGIN!r} ... {END!r})")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return head + BEGIN + "\n" + doc_table(nodes) + END + tail


def table_part(text: str) -> str:
    """The generated part of a doc (between the markers)."""
    return text.split(BEGIN, 1)[1].split(END, 1)[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", action="store_true")
    g.add_argument("--check", action="store_true")
    a = ap.parse_args(argv)
    wanted = {YAML_PATH: yaml_text()}
    for path, nodes in DOC_TABLES.items():
        wanted[path] = with_table(path.read_text(encoding="utf-8"), nodes, str(path.relative_to(ROOT)))
    if a.write:
        for path, text in wanted.items():
            path.write_text(text, encoding="utf-8")
        return 0
    bad = [str(p) for p, want in wanted.items() if p.read_text(encoding="utf-8") != want]
    if bad:
        print("out of date with vla_edge_ros/params.py: " + ", ".join(bad) +
              " (run python -m vla_edge_ros.ros.tools.param_docs --write)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
