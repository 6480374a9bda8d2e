"""Child processes for the benchmarks and the ROS tests: their environment, a wrapper stopped with SIGINT, RSS.

One place for what every ROS child process of this project needs (CONTRIBUTING.md): its own ROS_DOMAIN_ID,
discovery kept on localhost, a private ROS_HOME (rclpy would otherwise write logs to ~/.ros), Fast DDS with the
package's profile (32 MiB shared-memory segment, needed for 640x480 images), one BLAS thread. No rclpy here:
the callers start the ROS processes, this module only prepares and watches them.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
FASTDDS_PROFILE = ROOT / "config" / "fastdds_profile.xml"

# Middleware choices an operator may make in the shell (another RMW, another Fast DDS profile, a wider
# discovery range to watch from a second machine); kept when ``keep_operator_settings`` is true.
OPERATOR_SETTINGS = {
    "RMW_IMPLEMENTATION": "rmw_fastrtps_cpp",
    "FASTRTPS_DEFAULT_PROFILES_FILE": str(FASTDDS_PROFILE),
    "ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST",
}


def ros_child_env(domain_id: Optional[int] = None, ros_home: Optional[Path] = None, base: Optional[dict] = None,
                  *, keep_operator_settings: bool = True) -> dict[str, str]:
    """Environment for a ROS child process, built from ``base`` (default: this process's environment).

    ``domain_id``: ROS_DOMAIN_ID when given (0-232), else whatever ``base`` has. ``ros_home``: ROS_HOME (created)
    and ROS_LOG_DIR=<ros_home>/log when given, else whatever ``base`` has. RMW_IMPLEMENTATION, the Fast DDS
    profile and the discovery range are set to this project's values; with ``keep_operator_settings`` (the
    benchmarks) a value already in ``base`` wins, without it (the tests) ours always do. The checkout goes first
    on PYTHONPATH so ``python -m vla_edge_ros...`` runs this code; output is unbuffered (logs are read live);
    OPENBLAS_NUM_THREADS defaults to 1 (see vla_edge_ros/ros/__init__.py); ROS_LOCALHOST_ONLY is dropped
    (deprecated in Jazzy; it conflicts with the discovery range)."""
    if domain_id is not None and not 0 <= domain_id <= 232:
        raise ValueError(f"ROS_DOMAIN_ID must be in 0..232, got {domain_id}")
    env = dict(os.environ if base is None else base)
    if domain_id is not None:
        env["ROS_DOMAIN_ID"] = str(domain_id)
    for name, value in OPERATOR_SETTINGS.items():
        if keep_operator_settings:
            env.setdefault(name, value)
        else:
            env[name] = value
    if ros_home is not None:
        home = Path(ros_home)
        home.mkdir(parents=True, exist_ok=True)
        env["ROS_HOME"] = str(home)
        env["ROS_LOG_DIR"] = str(home / "log")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env.pop("ROS_LOCALHOST_ONLY", None)
    return env


ACTIVE_LINE = "active: admitting chunks"  # vla_inference's log line once warm-up is done (ros/inference_node.py)


def wait_active(runtime: "Child", timeout_s: float, poll_s: float = 0.2) -> Optional[str]:
    """Wait until ``runtime``'s log says inference is active (engine loaded, quantised, warmed up): None, or why
    not (it exited, or ``timeout_s`` passed). Benchmarks start their camera or replay only then, so that a
    duration is time spent serving, not loading (a 1.5B checkpoint quantised at load takes up to ~50 s)."""
    t_end = time.monotonic() + timeout_s
    while ACTIVE_LINE not in runtime.output():
        if not runtime.alive():
            return f"{runtime.name} exited with {runtime.p.returncode} during start-up (see {runtime.log_path})"
        if time.monotonic() > t_end:
            return f"{runtime.name} not active after {timeout_s:.0f} s (see {runtime.log_path})"
        time.sleep(poll_s)
    return None


class Child:
    """A child process with its output in a file (a pipe could fill up during a long run), stopped with SIGINT.

    ``name`` defaults to the module of a ``python -m module ...`` command line. ``cwd`` defaults to the checkout;
    pass ``cwd=None`` to keep the caller's working directory (relative paths given by a user)."""

    def __init__(self, args: Sequence[str], env: dict, log_path: Path, name: str = "",
                 cwd: Optional[Path] = ROOT):
        self.name = name or Path(args[2] if len(args) > 2 else args[0]).name
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "wb")
        self._interrupted = False
        self.p = subprocess.Popen(list(args), env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                  cwd=None if cwd is None else str(cwd))

    def alive(self) -> bool:
        return self.p.poll() is None

    def output(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def interrupt(self) -> None:
        """SIGINT once, without waiting (to stop several children together); a second SIGINT during an rclpy
        shutdown would interrupt the shutdown itself."""
        if self.p.poll() is None and not self._interrupted:
            self.p.send_signal(signal.SIGINT)
            self._interrupted = True

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGINT (unless already sent) and wait; returns the exit code, or -9 after a SIGKILL when it did not
        exit within ``timeout_s``."""
        if self.p.poll() is None:
            self.interrupt()
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


def rss_mb(pid: int, tree: bool = False) -> Optional[float]:
    """Resident memory of ``pid`` in MiB; with ``tree`` of it and all its descendants. None once it is gone.

    One process: VmRSS from /proc (no dependency). Tree: psutil (None when psutil is missing)."""
    if tree:
        try:
            import psutil

            p = psutil.Process(pid)
            return sum(q.memory_info().rss for q in [p] + p.children(recursive=True)) / 2**20
        except Exception:
            return None
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        return None
    return None
