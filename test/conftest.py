"""Shared fixtures of the test suite (the helpers behind them: ros_env.py).

- ``ros_domain``: the test module's ROS_DOMAIN_ID, one no other test process on this machine holds
  (ros_env.allocate_domain_ids); a module marked ``pytest.mark.ros_domains(n)`` gets the first of n consecutive
  ids (vla_eval runs one setting per domain);
- ``ros_processes`` / ``module_ros_processes``: a ros_env.RosProcesses for one test / for one module's
  module-scoped fixtures: vla_edge_ros executables (runtime, test camera, action monitor, bag replay, sim...)
  started as child processes in the isolated ROS environment of that domain (loopback discovery, a temporary
  ROS_HOME, the package's Fast DDS profile); at the end every one still running is stopped with SIGINT, and any
  that had to be killed fails the test;
- ``ros_context``: an rclpy Context in this process on that domain, with the same settings;
- ``torch_cuda``: torch on a usable GPU (the GPU tests; skipped without PyCUDA, a GPU or torch).
"""
from __future__ import annotations

import pytest

from ros_env import RosProcesses, allocate_domain_ids, rclpy_context


def pytest_configure(config):
    config.addinivalue_line("markers", "ros_domains(n): the module needs n consecutive ROS domain ids "
                                       "(the ros_domain fixture is the first)")


@pytest.fixture(scope="module")
def ros_domain(request) -> int:
    marker = request.node.get_closest_marker("ros_domains")
    return allocate_domain_ids(marker.args[0] if marker else 1)


def _processes(domain_id: int, tmp):
    procs = RosProcesses(domain_id, tmp)
    yield procs
    killed = procs.stop_all()
    assert not killed, f"processes did not exit on SIGINT and were killed: {killed}"


@pytest.fixture
def ros_processes(ros_domain, tmp_path):
    yield from _processes(ros_domain, tmp_path)


@pytest.fixture(scope="module")
def module_ros_processes(ros_domain, tmp_path_factory):
    yield from _processes(ros_domain, tmp_path_factory.mktemp("ros_module"))


@pytest.fixture
def ros_context(ros_domain, tmp_path):
    pytest.importorskip("rclpy")
    with rclpy_context(ros_domain, tmp_path / "ros_home") as ctx:
        yield ctx


@pytest.fixture(scope="module")
def torch_cuda():
    """torch, with TF32 off (the GPU tests compare against float32 references)."""
    from vla_edge_ros.engine.cuda import cuda_status

    ok, why = cuda_status()
    if not ok:
        pytest.skip(f"no usable GPU: {why}")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch
