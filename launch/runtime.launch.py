"""Launch the vla_edge_ros runtime.

    ros2 launch vla_edge_ros runtime.launch.py                       # test camera + runtime (role all), active
    ros2 launch vla_edge_ros runtime.launch.py use_test_camera:=false camera_topic:=/my_cam/image_raw
    ros2 launch vla_edge_ros runtime.launch.py role:=edge            # GPU server: camera subscriber + inference
    ros2 launch vla_edge_ros runtime.launch.py role:=robot use_test_camera:=false   # robot: action publisher
    ros2 launch vla_edge_ros runtime.launch.py autostart:=false      # vla_inference stays unconfigured
    ros2 launch vla_edge_ros runtime.launch.py bag:=/data/episode_0  # replay a bag as the camera

Arguments override the matching entries of params_file (default: the installed config/runtime.yaml).
FASTRTPS_DEFAULT_PROFILES_FILE is set to the installed config/fastdds_profile.xml (32 MiB shared-memory
segment) unless the caller already set it.
"""
import os

from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction, SetEnvironmentVariable
from launch.conditions import IfCondition
from launch.substitutions import LaunchConfiguration, PythonExpression
from launch_ros.actions import Node

PACKAGE = "vla_edge_ros"
EVICTION_POLICIES = ("semantic", "fifo", "sliding_window")  # == vla_edge_ros.params.EVICTION_POLICIES
BACKENDS = ("auto", "cuda", "numpy")
ROLES = ("all", "robot", "edge")


def _share_dir() -> str:
    try:
        from ament_index_python.packages import get_package_share_directory

        return get_package_share_directory(PACKAGE)
    except Exception:  # not installed through colcon (source checkout / pip -e): use the source tree
        return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _runtime(context, *args, **kwargs):
    get = lambda name: LaunchConfiguration(name).perform(context)  # noqa: E731
    role = get("role")
    overrides = {"vla_inference": {}, "vla_camera": {}, "vla_action": {}}
    if get("eviction_policy"):
        overrides["vla_inference"]["eviction_policy"] = get("eviction_policy")
    if get("checkpoint"):
        overrides["vla_inference"]["checkpoint"] = get("checkpoint")
    if get("backend"):
        overrides["vla_inference"]["backend"] = get("backend")
    if get("camera_topic"):
        overrides["vla_camera"]["camera_topic"] = get("camera_topic")
    parameters = [get("params_file")]
    flat = {}
    for values in overrides.values():  # one process holds all three nodes: plain names reach the right one
        flat.update(values)
    if flat:
        parameters.append(flat)
    arguments = ["--role", role, "--lifecycle-autostart" if get("autostart").lower() in ("true", "1") else
                 "--no-autostart"]
    if get("stats_out"):
        arguments += ["--stats-out", get("stats_out")]
    actions = [Node(package=PACKAGE, executable="vla_runtime", name=None, output="screen", emulate_tty=True,
                    arguments=arguments, parameters=parameters, sigterm_timeout="10")]
    return actions


def generate_launch_description() -> LaunchDescription:
    share = _share_dir()
    args = [
        DeclareLaunchArgument("params_file", default_value=os.path.join(share, "config", "runtime.yaml"),
                              description="ROS parameters of vla_camera / vla_inference / vla_action"),
        DeclareLaunchArgument("eviction_policy", default_value="", choices=("",) + EVICTION_POLICIES,
                              description="KV eviction policy (empty: the params file's value)"),
        DeclareLaunchArgument("checkpoint", default_value="",
                              description="HF-layout checkpoint directory (empty: the embedded tiny default)"),
        DeclareLaunchArgument("backend", default_value="", choices=("",) + BACKENDS,
                              description="inference backend (empty: the params file's value, default auto)"),
        DeclareLaunchArgument("camera_topic", default_value="",
                              description="sensor_msgs/Image topic (empty: the params file's value)"),
        DeclareLaunchArgument("use_test_camera", default_value="true", choices=("true", "false"),
                              description="also start vla_test_camera (60 Hz moving test pattern)"),
        DeclareLaunchArgument("role", default_value="all", choices=ROLES,
                              description="all: one process; edge: camera + inference; robot: action publisher"),
        DeclareLaunchArgument("autostart", default_value="true", choices=("true", "false"),
                              description="bring vla_inference to 'active' (false: leave it unconfigured)"),
        DeclareLaunchArgument("bag", default_value="",
                              description="rosbag2 directory to replay as the camera (starts vla_bag_replay)"),
        DeclareLaunchArgument("stats_out", default_value="", description="write the runtime's figures here"),
    ]
    profile = os.path.join(share, "config", "fastdds_profile.xml")
    env = [SetEnvironmentVariable("FASTRTPS_DEFAULT_PROFILES_FILE",
                                  os.environ.get("FASTRTPS_DEFAULT_PROFILES_FILE", profile))]
    test_camera = Node(
        package=PACKAGE, executable="vla_test_camera", output="screen",
        condition=IfCondition(PythonExpression([
            "'", LaunchConfiguration("use_test_camera"), "' == 'true' and '", LaunchConfiguration("bag"),
            "' == '' and '", LaunchConfiguration("role"), "' != 'robot'"])),
        parameters=[{"topic": PythonExpression([
            "'", LaunchConfiguration("camera_topic"), "' or '/camera/image_raw'"])}])
    bag_replay = Node(
        package=PACKAGE, executable="vla_bag_replay", output="screen",
        condition=IfCondition(PythonExpression(["'", LaunchConfiguration("bag"), "' != ''"])),
        # The runtime's default camera input is raw sensor_msgs/Image at camera rate: decode the bag's JPEG
        # frames, re-time them to a 60 Hz camera and loop the clip.
        arguments=["--bag", LaunchConfiguration("bag"), "--decode", "--camera-hz", "60", "--loop"])
    return LaunchDescription(args + env + [test_camera, bag_replay, OpaqueFunction(function=_runtime)])
