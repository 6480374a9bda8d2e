"""launch/runtime.launch.py through launch_pytest, on a ROS 2 installation with the package built
(`colcon build`, `source install/setup.bash`). launch, launch_ros and launch_pytest are not on PyPI, so this
module skips cleanly in the PyPI-only `make test`.

`ros2 launch <this repo's launch file>` starts the test camera and vla_runtime (role all, backend numpy); the
test waits for the inference node to log 'active', then launch_pytest shuts everything down."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

launch_pytest = pytest.importorskip("launch_pytest")
launch = pytest.importorskip("launch")
pytest.importorskip("launch_ros")
if shutil.which("ros2") is None:
    pytest.skip("the ros2 command line (a ROS 2 installation) is not available", allow_module_level=True)

from launch_pytest.tools import process as process_tools  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOMAIN_ID = 16


@pytest.fixture
def launch_proc(tmp_path):
    env = dict(os.environ, ROS_DOMAIN_ID=str(DOMAIN_ID), ROS_AUTOMATIC_DISCOVERY_RANGE="LOCALHOST",
               ROS_HOME=str(tmp_path), RMW_IMPLEMENTATION="rmw_fastrtps_cpp", PYTHONUNBUFFERED="1")
    env.pop("FASTRTPS_DEFAULT_PROFILES_FILE", None)  # the launch file must set it itself
    return launch.actions.ExecuteProcess(
        cmd=["ros2", "launch", str(ROOT / "launch" / "runtime.launch.py"), "backend:=numpy",
             "use_test_camera:=true", "role:=all", "eviction_policy:=fifo"],
        env=env, output="screen", cached_output=True, sigterm_timeout="15")


@launch_pytest.fixture
def launch_description(launch_proc):
    return launch.LaunchDescription([launch_proc, launch_pytest.actions.ReadyToTest()])


@pytest.mark.launch(fixture=launch_description)
async def test_runtime_launch_reaches_active(launch_proc):
    await process_tools.wait_for_output(launch_proc, lambda out: "active: admitting chunks" in out, timeout=120)
    await process_tools.wait_for_output(launch_proc, lambda out: "publishing rgb8 640x480" in out, timeout=30)
