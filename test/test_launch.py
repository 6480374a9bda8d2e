"""launch/runtime.launch.py through launch_pytest, on a ROS 2 installation with the package built
(`colcon build`, `source install/setup.bash`). launch, launch_ros and launch_pytest are not on PyPI, so this
module skips cleanly in the PyPI-only `make test`.

`ros2 launch <this repo's launch file>` starts the test camera and vla_runtime (role all, backend numpy); the
test waits for the inference node to log 'active' and the test camera to log what it publishes, then
launch_pytest shuts everything down. launch_pytest's ``wait_for_output(launch_context, action, fn, timeout)``
returns False on a timeout instead of raising, so each wait is asserted.

On Jazzy this needs pytest < 8.4 (Ubuntu 24.04's python3-pytest is 7.4.4): launch_pytest 3.4 reads
``fixture._pytestfixturefunction``, which pytest 8.4 removed; the `test` extra of setup.py pins it."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

launch_pytest = pytest.importorskip("launch_pytest")
launch = pytest.importorskip("launch")
pytest.importorskip("launch_ros")
if shutil.which("ros2") is None:
    pytest.skip("the ros2 command line (a ROS 2 installation) is not available", allow_module_level=True)

from launch_pytest.tools import process as process_tools  # noqa: E402
from ros_env import ros_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ACTIVE_LINE = "active: admitting chunks"  # vla_edge_ros/ros/inference_node.py, on activate
CAMERA_LINE = "publishing rgb8 640x480"  # vla_edge_ros/ros/tools/test_camera.py, at start-up (default size/encoding)


@pytest.fixture
def launch_proc(ros_domain, tmp_path):
    env = ros_env(ros_domain, tmp_path)
    env.pop("FASTRTPS_DEFAULT_PROFILES_FILE", None)  # the launch file must set it itself
    return launch.actions.ExecuteProcess(
        cmd=["ros2", "launch", str(ROOT / "launch" / "runtime.launch.py"), "backend:=numpy",
             "use_test_camera:=true", "role:=all", "eviction_policy:=fifo"],
        env=env, output="screen", cached_output=True, sigterm_timeout="15")


@launch_pytest.fixture
def launch_description(launch_proc):
    return launch.LaunchDescription([launch_proc, launch_pytest.actions.ReadyToTest()])


def _tail(proc, n: int = 4000) -> str:
    return (proc.get_stdout() or "")[-n:]


@pytest.mark.launch(fixture=launch_description)
async def test_runtime_launch_reaches_active(launch_proc, launch_context):
    # `ros2 launch` prints its nodes' stdout and stderr (rclpy logs) on its own stdout: cached_output sees both.
    active = await process_tools.wait_for_output(launch_context, launch_proc, lambda out: ACTIVE_LINE in out,
                                                 timeout=120)
    assert active, f"no '{ACTIVE_LINE}' within 120 s; launch output ends with:\n{_tail(launch_proc)}"
    camera = await process_tools.wait_for_output(launch_context, launch_proc, lambda out: CAMERA_LINE in out,
                                                 timeout=30)
    assert camera, f"no '{CAMERA_LINE}' within 30 s; launch output ends with:\n{_tail(launch_proc)}"
    assert "Traceback" not in launch_proc.get_stdout(), _tail(launch_proc)
