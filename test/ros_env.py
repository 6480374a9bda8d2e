"""Environment and process helpers for the ROS integration tests (real rclpy processes).

Every test module picks its own ROS_DOMAIN_ID (range 10-39 for the ROS-layer tests) so parallel or leftover
processes never cross-talk; discovery stays on localhost; ROS_HOME is a temporary directory (rclpy would
otherwise write logs to ~/.ros); Fast DDS uses the package's profile (32 MiB shared-memory segment).
Node processes are stopped with SIGINT and the tests check they exit.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def ros_env(domain_id: int, tmp: Optional[Path] = None) -> dict[str, str]:
    if not 0 <= domain_id <= 232:
        raise ValueError(domain_id)
    home = Path(tmp) if tmp else Path(tempfile.mkdtemp(prefix="vla_ros_home_"))
    home.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update({
        "ROS_DOMAIN_ID": str(domain_id),
        "ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST",
        "ROS_HOME": str(home),
        "ROS_LOG_DIR": str(home / "log"),
        "RMW_IMPLEMENTATION": "rmw_fastrtps_cpp",
        "FASTRTPS_DEFAULT_PROFILES_FILE": str(ROOT / "config" / "fastdds_profile.xml"),
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    })
    env.pop("ROS_LOCALHOST_ONLY", None)  # deprecated in Jazzy; conflicts with the discovery range
    return env


def apply_env(domain_id: int, tmp: Optional[Path] = None) -> dict[str, str]:
    """Set the variables in THIS process too (for an in-test rclpy context); returns the env dict."""
    env = ros_env(domain_id, tmp)
    for k in ("ROS_DOMAIN_ID", "ROS_AUTOMATIC_DISCOVERY_RANGE", "ROS_HOME", "ROS_LOG_DIR", "RMW_IMPLEMENTATION",
              "FASTRTPS_DEFAULT_PROFILES_FILE"):
        os.environ[k] = env[k]
    os.environ.pop("ROS_LOCALHOST_ONLY", None)
    return env


class Proc:
    """A child process with its output in a file (no pipe to fill up), stopped with SIGINT."""

    def __init__(self, args: Sequence[str], env: dict, log_path: Path, name: str = ""):
        self.name = name or Path(args[2] if len(args) > 2 else args[0]).name
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "wb")
        self.p = subprocess.Popen(list(args), env=env, stdout=self._log, stderr=subprocess.STDOUT, cwd=str(ROOT))

    def alive(self) -> bool:
        return self.p.poll() is None

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGINT, wait; returns the exit code (SIGKILL + AssertionError-worthy -9 when it does not exit)."""
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGINT)
            try:
                self.p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(5)
                self._log.close()
                return -9
        self._log.close()
        return self.p.returncode

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(5)
        self._log.close()

    def output(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


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
