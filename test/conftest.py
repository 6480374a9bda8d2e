"""Shared fixtures of the test suite.

- ``ros_domain``: a ROS_DOMAIN_ID no other test process on this machine holds (ros_env.allocate_domain_ids), for
  tests that do not keep a module-level one;
- ``ros_processes``: starts vla_edge_ros executables (runtime, test camera, sim...) as child processes in an
  isolated ROS environment (that domain, loopback discovery, a temporary ROS_HOME, the package's Fast DDS
  profile) and stops every one of them with SIGINT at the end of the test, reporting any that had to be killed.
"""
from __future__ import annotations

import pytest

from ros_env import Proc, allocate_domain_ids, module_cmd, ros_env


@pytest.fixture
def ros_domain() -> int:
    return allocate_domain_ids(1)


class RosProcesses:
    """Factory of child processes sharing one isolated ROS environment (see the module docstring)."""

    def __init__(self, domain_id: int, tmp_path):
        self.domain_id = domain_id
        self.tmp = tmp_path
        self.env = ros_env(domain_id, tmp_path / "ros_home")
        self.procs: list[Proc] = []

    def start(self, module: str, *args: str, name: str = "") -> Proc:
        name = name or module.rsplit(".", 1)[-1]
        proc = Proc(module_cmd(module, *args), self.env, self.tmp / f"{name}_{len(self.procs)}.log")
        self.procs.append(proc)
        return proc

    def runtime(self, *ros_args: str, role: str = "all", stats_out=None) -> Proc:
        """vla_runtime with the given ``-p name:=value`` arguments (numpy backend unless overridden)."""
        extra = ["--stats-out", str(stats_out)] if stats_out else []
        return self.start("vla_edge_ros.ros.runtime", "--role", role, *extra, "--ros-args",
                          "-p", "backend:=numpy", *ros_args, name="runtime")

    def camera(self, *ros_args: str) -> Proc:
        """vla_test_camera (60 Hz rgb8 640x480 unless overridden)."""
        return self.start("vla_edge_ros.ros.tools.test_camera", *(["--ros-args", *ros_args] if ros_args else []),
                          name="camera")

    def stop_all(self) -> list[str]:
        killed = []
        for p in reversed(self.procs):  # SIGINT to all first: they shut down in parallel
            p.interrupt()
        for p in reversed(self.procs):
            if p.stop() == -9:
                killed.append(f"{p.name} (log {p.log_path})")
        return killed


@pytest.fixture
def ros_processes(ros_domain, tmp_path):
    procs = RosProcesses(ros_domain, tmp_path)
    yield procs
    killed = procs.stop_all()
    assert not killed, f"processes did not exit on SIGINT and were killed: {killed}"
