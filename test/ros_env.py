"""Environment and process helpers for the ROS integration tests (real rclpy processes).

One place for what every ROS test needs (conftest.py turns it into fixtures):
- a ROS_DOMAIN_ID per test module from ``allocate_domain_ids`` (a lock file per id, held for the life of the test
  process), so modules, parallel pytest runs on one machine and leftover processes never cross-talk and no id
  range is kept by hand;
- the environment: discovery on localhost, ROS_HOME a temporary directory (rclpy would otherwise write logs to
  ~/.ros), Fast DDS with the package's profile (32 MiB shared-memory segment); ``apply_env`` / ``rclpy_context``
  give this process the same settings for an in-test rclpy node;
- ``RosProcesses``: the vla_edge_ros executables a test starts (runtime, test camera, action monitor, bag replay,
  sim...), each with its output in a log file, stopped with SIGINT (``stop`` returns their exit codes for the test
  to assert); whatever is still running at the end is stopped by the fixture, and one that ignores SIGINT is
  killed and reported.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

from vla_edge_ros.bench.procs import Child, ros_child_env

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable

# Fast DDS maps a domain id to UDP ports 7400 + 250 * id + ...: ids up to 101 stay below 32768 for any
# participant count used here. 0 is the operator's default domain: never used by tests.
DOMAIN_IDS = range(1, 102)
_held_locks: list = []  # open lock files: closed (released) when this process exits


def allocate_domain_ids(count: int = 1) -> int:
    """The first of ``count`` consecutive ROS domain ids no other test process on this machine holds.

    Each id is claimed with an exclusive, non-blocking ``flock`` on a file in the temporary directory and stays
    claimed until this process exits (the kernel releases a dead process's locks, so a crashed run leaks
    nothing). Raises RuntimeError when none is free."""
    import fcntl

    lock_dir = Path(tempfile.gettempdir()) / "vla_edge_ros_domains"
    lock_dir.mkdir(exist_ok=True)
    for first in DOMAIN_IDS:
        if first + count - 1 > DOMAIN_IDS[-1]:
            break
        taken = []
        for i in range(first, first + count):
            f = open(lock_dir / f"{i}.lock", "a")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                f.close()
                break
            taken.append(f)
        if len(taken) == count:
            _held_locks.extend(taken)
            return first
        for f in taken:
            f.close()
    raise RuntimeError(f"no {count} consecutive free ROS domain ids in {DOMAIN_IDS} (lock files in {lock_dir})")


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


@contextlib.contextmanager
def rclpy_context(domain_id: int, home: Path):
    """An rclpy Context of its own in this process, on ``domain_id`` with the tests' settings (apply_env);
    shut down afterwards."""
    import rclpy

    apply_env(domain_id, home)
    ctx = rclpy.context.Context()
    rclpy.init(context=ctx, args=[])
    try:
        yield ctx
    finally:
        rclpy.shutdown(context=ctx)


Proc = Child  # the tests' name for vla_edge_ros.bench.procs.Child (stop() waits 15 s by default)
ACTIVE_LINE = "active: admitting chunks"  # vla_edge_ros/ros/inference_node.py logs it on activate
RUNTIME, CAMERA, MONITOR = "vla_edge_ros.ros.runtime", "vla_edge_ros.ros.tools.test_camera", \
    "vla_edge_ros.ros.tools.action_monitor"
BAG_REPLAY, SIM = "vla_edge_ros.ros.tools.bag_replay", "vla_edge_ros.ros.sim_node"


def module_cmd(module: str, *args: str) -> list[str]:
    return [PY, "-m", module, *args]


def runtime_cmd(*ros_args: str, role: str = "all", stats_out=None, stats_every_s: Optional[float] = None,
                cli: Sequence[str] = (), backend: Optional[str] = "numpy") -> list[str]:
    """vla_runtime's command line: ``--role``, the stats options, ``cli``, then ``--ros-args`` with
    ``-p backend:=<backend>`` (none when backend is None) and ``ros_args``."""
    args = ["--role", role]
    if stats_out is not None:
        args += ["--stats-out", str(stats_out)]
    if stats_every_s is not None:
        args += ["--stats-every-s", str(stats_every_s)]
    args += list(cli)
    params = (["-p", f"backend:={backend}"] if backend else []) + list(ros_args)
    return module_cmd(RUNTIME, *args, *(["--ros-args", *params] if params else []))


class RosProcesses:
    """The child processes of one test (or one module) sharing one isolated ROS environment: ``domain_id``,
    loopback discovery, ``<tmp>/ros_home`` as ROS_HOME, the package's Fast DDS profile. Each process writes its
    output to ``<tmp>/<name>.log``. ``stop`` stops the given ones in order (SIGINT, then wait) and returns their
    exit codes by name; ``stop_all`` (the fixtures' teardown) stops whatever is still running."""

    def __init__(self, domain_id: int, tmp: Path):
        self.domain_id = domain_id
        self.tmp = Path(tmp)
        self.home = self.tmp / "ros_home"
        self.env = ros_env(domain_id, self.home)
        self.procs: list[Proc] = []

    def apply_env(self) -> dict[str, str]:
        """The same settings in THIS process (for an in-test rclpy node talking to the children)."""
        return apply_env(self.domain_id, self.home)

    # ---- starting ---------------------------------------------------------------------------------------------
    def start_cmd(self, cmd: Sequence[str], name: str, extra_env: Optional[dict] = None) -> Proc:
        """Any command line in this environment (plus ``extra_env``); ``name`` names it and its log."""
        used, unique, n = {p.name for p in self.procs}, name, 1
        while unique in used:  # a second process of that name: name_2, ...
            n += 1
            unique = f"{name}_{n}"
        proc = Proc(list(cmd), {**self.env, **(extra_env or {})}, self.tmp / f"{unique}.log", name=unique)
        self.procs.append(proc)
        return proc

    def start(self, module: str, *args, name: str = "", extra_env: Optional[dict] = None) -> Proc:
        """``python -m module args...`` (name: the module's last part unless given)."""
        return self.start_cmd(module_cmd(module, *map(str, args)), name or module.rsplit(".", 1)[-1], extra_env)

    def runtime(self, *ros_args: str, role: str = "all", stats_out=None, stats_every_s: Optional[float] = None,
                cli: Sequence[str] = (), backend: Optional[str] = "numpy", name: str = "runtime",
                extra_env: Optional[dict] = None) -> Proc:
        """vla_runtime (numpy backend unless overridden) with the given ``--ros-args`` (see runtime_cmd)."""
        return self.start_cmd(runtime_cmd(*ros_args, role=role, stats_out=stats_out, stats_every_s=stats_every_s,
                                          cli=cli, backend=backend), name, extra_env)

    def camera(self, *ros_args: str, cli: Sequence[str] = (), name: str = "camera") -> Proc:
        """vla_test_camera (60 Hz rgb8 640x480 unless overridden), ``cli`` options before ``--ros-args``."""
        return self.start(CAMERA, *cli, *(["--ros-args", *ros_args] if ros_args else []), name=name)

    def monitor(self, out: Path, name: str = "monitor") -> Proc:
        """The action monitor, recording /vla/action and /vla/action_status as JSON lines in ``out``."""
        return self.start(MONITOR, "--out", out, name=name)

    def run(self, module: str, *args, timeout_s: float, cwd: Path = ROOT) -> subprocess.CompletedProcess:
        """``python -m module args...`` to its end (a one-shot tool); stdout and stderr captured as text. A child
        still running after ``timeout_s`` is killed (subprocess.TimeoutExpired)."""
        return subprocess.run(module_cmd(module, *map(str, args)), env=self.env, cwd=str(cwd), capture_output=True,
                              text=True, timeout=timeout_s)

    # ---- waiting and stopping ---------------------------------------------------------------------------------
    @staticmethod
    def wait_active(runtime: Proc, timeout_s: float = 60.0) -> None:
        """Until the runtime's inference node admits chunks (asserted, with its output)."""
        assert wait_for(lambda: ACTIVE_LINE in runtime.output(), timeout_s), runtime.output()

    @staticmethod
    def stop(*procs: Proc) -> dict[str, int]:
        """Stop each in the order given (SIGINT, wait up to 15 s, else SIGKILL: -9); exit codes by name."""
        return {p.name: p.stop() for p in procs}

    def stop_all(self) -> list[str]:
        """Stop every process still running (SIGINT to all first: they shut down in parallel); closes every log.
        Returns those that had to be killed (ignored SIGINT), with their logs."""
        running = [p for p in reversed(self.procs) if p.alive()]
        for p in running:
            p.interrupt()
        killed = [f"{p.name} (log {p.log_path})" for p in running if p.stop() == -9]
        for p in self.procs:  # exited by themselves or killed by the test: only the log to close
            p.stop()
        return killed


def single_node_cmd(kind: str, *args: str) -> list[str]:
    """What the vla_camera / vla_inference / vla_action console scripts run (ros/runtime.py's *_main)."""
    return [PY, "-c", f"import sys; from vla_edge_ros.ros.runtime import {kind}_main; sys.exit({kind}_main())",
            *args]


def wait_for(predicate, timeout_s: float, poll_s: float = 0.05) -> bool:
    t_end = time.monotonic() + timeout_s
    while time.monotonic() < t_end:
        if predicate():
            return True
        time.sleep(poll_s)
    return predicate()


def call_answered(send, timeout_s: float = 60.0, resend_every_s: float = 2.0, what: str = "request"):
    """send() -> rclpy Future of a service request that is safe to repeat; resent until one is answered.

    A client's wait_for_service() only says that the server's request reader is discovered. Until the server
    has also matched the client's response reader, its response is dropped and the future never completes
    (rmw_fastrtps waits only 100 ms for that reader before giving up on the response: ros2/rmw_fastrtps#390 and
    #467; seen in CI on 2 loaded cores: a lifecycle GetState right after wait_for_service unanswered for 60 s).
    So the first request on each service goes through here; once one answer came back, both directions are
    matched."""
    t_end = time.monotonic() + timeout_s
    while True:
        fut = send()
        if wait_for(fut.done, max(min(resend_every_s, t_end - time.monotonic()), 0.0)):
            return fut.result()
        assert time.monotonic() < t_end, f"no answer to {what} in {timeout_s:.0f} s"


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def read_json_when(path: Path, pred, timeout_s: float = 10.0, show=None) -> dict:
    """The JSON at ``path`` once ``pred(json)`` holds (a file being rewritten may be unreadable for a moment).
    show(last json or None): what the failure message shows (default: the whole JSON)."""
    box = {}

    def check():
        try:
            box["s"] = read_json(path)
        except (ValueError, OSError):
            return False
        return pred(box["s"])

    assert wait_for(check, timeout_s, 0.1), show(box.get("s")) if show else box.get("s")
    return box["s"]


def load_monitor(path: Path) -> tuple[list[dict], list[dict]]:
    """(action records, status records) from an action_monitor JSON-lines file."""
    actions, statuses = [], []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        (actions if rec["topic"] == "action" else statuses).append(rec)
    return actions, statuses


def fresh_after(path: Path, t0: float) -> int:
    """Fresh actions an action_monitor file holds with receive time (monotonic) after ``t0``, read while the
    monitor writes it: for wait_for predicates, so a file not created yet counts 0 and a line being written is
    skipped (either raising there ended the wait at once: CI, 2 loaded cores)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return 0
    count = 0
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:  # a line being written
            continue
        count += rec["topic"] == "action" and rec["kind"] == "fresh" and rec["t"] > t0
    return count


def runs(kinds: list[str]) -> list[tuple[str, int, int]]:
    """Run-length encoding: [(kind, start index, length), ...]."""
    out: list[tuple[str, int, int]] = []
    for i, k in enumerate(kinds):
        if out and out[-1][0] == k:
            out[-1] = (k, out[-1][1], out[-1][2] + 1)
        else:
            out.append((k, i, 1))
    return out


@contextlib.contextmanager
def runtime_with_param_clients(procs: RosProcesses, client_name: str, client_nodes: tuple[str, ...],
                               stats_every_s: float, setup_node=None):
    """``vla_runtime`` (numpy backend, 1024-token budget, stats JSON every ``stats_every_s``) + a 30 Hz 160x120
    test camera started by ``procs``, and an rclpy node in this process (own context, spun in a thread) with a
    parameter client per node of ``client_nodes``; ``setup_node(node)`` may add subscriptions. Yields a dict with
    ``clients``, ``stats`` (path), ``runtime`` (Proc) and ``node`` once the runtime admits chunks and the
    parameter services answer; afterwards both processes must exit 0 on SIGINT."""
    import rclpy
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.parameter_client import AsyncParameterClient

    procs.apply_env()
    stats = procs.tmp / "runtime.json"
    runtime = procs.runtime("-p", "kv_budget_tokens:=1024", stats_out=stats, stats_every_s=stats_every_s)
    camera = procs.camera("-p", "width:=160", "-p", "height:=120", "-p", "rate_hz:=30.0")
    ctx = rclpy.context.Context()
    rclpy.init(context=ctx, args=[])
    node = rclpy.create_node(client_name, context=ctx)
    if setup_node is not None:
        setup_node(node)
    ex = SingleThreadedExecutor(context=ctx)
    ex.add_node(node)
    threading.Thread(target=ex.spin, daemon=True).start()
    clients = {n: AsyncParameterClient(node, n) for n in client_nodes}
    try:
        procs.wait_active(runtime)
        for name, c in clients.items():
            assert c.wait_for_services(timeout_sec=20.0)
            call_answered(lambda: c.get_parameters(["use_sim_time"]), what=f"{name}/get_parameters")
        yield {"clients": clients, "stats": stats, "runtime": runtime, "node": node}
    finally:
        ex.shutdown(timeout_sec=2.0)
        node.destroy_node()
        rclpy.shutdown(context=ctx)
    codes = procs.stop(camera, runtime)
    assert codes == {"camera": 0, "runtime": 0}, runtime.output()[-3000:]
