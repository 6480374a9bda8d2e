"""package.xml lists only dependencies that `rosdep install` resolves on Jazzy and that the code really uses.

A key rosdep does not know (python3-safetensors was one) makes the README's `rosdep install` fail for every new
user; a package the code never imports (cv_bridge was one) pulls in a large install for nothing; a ROS package
the code imports but package.xml omits breaks `ros2 run` on a clean machine. This test catches all three.

The allow-lists below were checked against ros/rosdistro: jazzy/distribution.yaml (ROS packages) and
rosdep/python.yaml (python3-* keys; neither safetensors nor crc32c has one, rosbags only a pip key)."""
from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# ROS 2 Jazzy packages this project may depend on (all released in jazzy/distribution.yaml).
JAZZY_PACKAGES = {"rclpy", "rcl_interfaces", "builtin_interfaces", "sensor_msgs", "diagnostic_msgs",
                  "lifecycle_msgs", "std_msgs", "geometry_msgs", "ament_index_python", "launch", "launch_ros",
                  "launch_pytest", "launch_testing", "rmw_fastrtps_cpp", "trajectory_msgs"}
# rosdep keys (apt on Ubuntu / Debian) -> the Python module they provide.
ROSDEP_PYTHON_KEYS = {"python3-numpy": "numpy", "python3-yaml": "yaml", "python3-pil": "PIL",
                      "python3-tqdm": "tqdm", "python3-psutil": "psutil", "python3-matplotlib": "matplotlib",
                      "python3-pytest": "pytest", "python3-hypothesis": "hypothesis",
                      "python3-pytest-timeout": "pytest_timeout"}
# Used without an import statement: how the code uses each one (a string that must appear in the code).
USED_WITHOUT_IMPORT = {"lifecycle_msgs": "rclpy.lifecycle",  # vla_inference is a LifecycleNode: its services
                       "rmw_fastrtps_cpp": "rmw_fastrtps_cpp"}  # RMW_IMPLEMENTATION; config/fastdds_profile.xml
NEVER = {"cv_bridge": "images are converted with numpy (core/image_convert.py)",
         "python3-safetensors": "no rosdep key; engine/checkpoint.py parses .safetensors itself"}

IMPORT_RE = re.compile(r"^\s*(?:from|import)\s+([A-Za-z_][A-Za-z0-9_]*)", re.MULTILINE)


def depends(kind: str) -> list[str]:
    root = ET.parse(ROOT / "package.xml").getroot()
    return [(e.text or "").strip() for e in root.findall(kind)]


def sources(*folders: str) -> str:
    return "\n".join(p.read_text(errors="replace") for f in folders for p in sorted((ROOT / f).rglob("*.py")))


def imported(text: str) -> set[str]:
    return set(IMPORT_RE.findall(text))


def test_every_dependency_is_a_known_key_and_used():
    runtime, tests = sources("vla_edge_ros", "launch"), sources("test")
    problems = []
    for kind, text in (("exec_depend", runtime), ("test_depend", tests)):
        modules = imported(text)
        for key in depends(kind):
            if key in NEVER:
                problems.append(f"{kind} {key}: {NEVER[key]}")
            elif key in ROSDEP_PYTHON_KEYS:
                if ROSDEP_PYTHON_KEYS[key] not in modules:
                    problems.append(f"{kind} {key}: nothing imports {ROSDEP_PYTHON_KEYS[key]}")
            elif key in JAZZY_PACKAGES:
                use = USED_WITHOUT_IMPORT.get(key)
                if key not in modules and (use is None or use not in text):
                    problems.append(f"{kind} {key}: not imported" + (f" nor used as {use!r}" if use else ""))
            else:
                problems.append(f"{kind} {key}: not a rosdep key this test knows (check ros/rosdistro, then add)")
    assert not problems, "\n".join(problems)


def test_every_ros_package_the_code_imports_is_declared():
    declared = set(depends("exec_depend"))
    missing = sorted((imported(sources("vla_edge_ros", "launch")) & JAZZY_PACKAGES) - declared)
    assert not missing, f"imported by the code but not an exec_depend of package.xml: {missing}"
    declared_tests = declared | set(depends("test_depend"))
    missing = sorted((imported(sources("test")) & JAZZY_PACKAGES) - declared_tests)
    assert not missing, f"imported by the tests but neither an exec_depend nor a test_depend: {missing}"


def test_the_checker_rejects_what_broke_rosdep(tmp_path, monkeypatch):
    """The two entries that made `rosdep install` fail / install for nothing are caught by the check above."""
    xml = (ROOT / "package.xml").read_text().replace(
        "<exec_depend>rclpy</exec_depend>",
        "<exec_depend>rclpy</exec_depend><exec_depend>cv_bridge</exec_depend>"
        "<exec_depend>python3-safetensors</exec_depend><exec_depend>python3-nonexistent</exec_depend>")
    fake = tmp_path / "pkg"
    fake.mkdir()
    for folder in ("vla_edge_ros", "launch", "test"):
        (fake / folder).symlink_to(ROOT / folder)
    (fake / "package.xml").write_text(xml)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake)
    try:
        test_every_dependency_is_a_known_key_and_used()
    except AssertionError as exc:
        text = str(exc)
    else:
        raise AssertionError("a package.xml with cv_bridge / python3-safetensors passed the check")
    assert "cv_bridge" in text and "python3-safetensors" in text and "python3-nonexistent" in text
