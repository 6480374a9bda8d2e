"""Environment and process helpers for the ROS integration tests (real rclpy processes).

Every test module picks its own ROS_DOMAIN_ID (range 10-39 for the ROS-layer tests) so parallel or leftover
processes never cross-talk; discovery stays on localhost; ROS_HOME is a temporary directory (rclpy would
otherwise write logs to ~/.ros); Fast DDS uses the package's profile (32 MiB shared-memory segment).
Node processes are stopped with SIGINT and the tests check they exit.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from vla_edge_ros.bench.procs import Child, ros_child_env

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def ros_env(domain_id: int, tmp: Optional[Path] = None) -> dict[str, str]:
    """The tests' environment: our middleware settings always win over the shell's (keep_operator_settings off)."""
    home = Path(tmp) if tmp else Path(tempfile.mkdtemp(prefix="vla_ros_home_"))
    return ros_child_env(domain_id, home, keep_operator_settings=False)


def apply_env(domain_id: int, tmp: Optional[Path] = None) -> dict[str, str]:
    """Set the variables in THIS process too (for an in-test rclpy context); returns the env dict."""
    env = ros_env(domain_id, tmp)
    for k in ("ROS_DOMAIN_ID", "ROS_AUTOMATIC_DISCOVERY_RANGE", "ROS_HOME", "ROS_LOG_DIR", "RMW_IMPLEMENTATION",
              "FASTRTPS_DEFAULT_PROFILES_FILE"):
        os.environ[k] = env[k]
    os.environ.pop("ROS_LOCALHOST_ONLY", None)
    return env


Proc = Child  # the tests' name for vla_edge_ros.bench.procs.Child (stop() waits 15 s by default)


def module_cmd(module: str, *args: str) -> list[str]:
    return [PY, "-m", module, *args]


def wait_for(predicate, timeout_s: float, poll_s: float = 0.05) -> bool:
    t_end = time.monotonic() + timeout_s
    while time.monotonic() < t_end:
        if predicate():
            return True
        time.sleep(poll_s)
    return predicate()


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def load_monitor(path: Path) -> tuple[list[dict], list[dict]]:
    """(action records, status records) from an action_monitor JSON-lines file."""
    actions, statuses = [], []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        (actions if rec["topic"] == "action" else statuses).append(rec)
    return actions, statuses


def runs(kinds: list[str]) -> list[tuple[str, int, int]]:
    """Run-length encoding: [(kind, start index, length), ...]."""
    out: list[tuple[str, int, int]] = []
    for i, k in enumerate(kinds):
        if out and out[-1][0] == k:
            out[-1] = (k, out[-1][1], out[-1][2] + 1)
        else:
            out.append((k, i, 1))
    return out
