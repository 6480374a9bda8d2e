"""ament_python package: `colcon build` on a ROS 2 install, or `pip install -e .[ros-pypi,test]` (Makefile)."""
from glob import glob

from setuptools import find_packages, setup

package_name = "vla_edge_ros"

# ROS 2 Jazzy from PyPI wheels, for machines without a ROS install (the Makefile uses this extra). On a real
# ROS 2 install these come from the distribution (package.xml) and this extra is not installed.
ROS_PYPI = [
    "ros-jazzy-rclpy",
    "ros-jazzy-sensor-msgs",
    "ros-jazzy-std-msgs",
    "ros-jazzy-geometry-msgs",
    "ros-jazzy-diagnostic-msgs",
    "ros-jazzy-lifecycle-msgs",
    "ros-jazzy-trajectory-msgs",
    "ros-jazzy-rmw-fastrtps-cpp",
]

setup(
    name=package_name,
    version="0.1.0",
    packages=find_packages(exclude=["test", "test.*"]),
    data_files=[
        ("share/ament_index/resource_index/packages", ["resource/" + package_name]),
        ("share/" + package_name, ["package.xml"]),
        ("share/" + package_name + "/launch", glob("launch/*.launch.py")),
        ("share/" + package_name + "/config", glob("config/*.yaml") + glob("config/*.xml")),
        ("share/" + package_name + "/cuda", glob("cuda/*.cu") + glob("cuda/*.cuh")),
    ],
    # the shipped trained policies (engine/shipped.py): config.json, model.safetensors, record, manifest
    package_data={package_name: ["policies/*/*.json", "policies/*/*.safetensors", "policies/*/*.md"]},
    # engine/checkpoint.py parses .safetensors itself; the safetensors package only writes them (tests, tools)
    install_requires=["setuptools", "numpy>=1.24", "PyYAML"],
    extras_require={
        "ros-pypi": ROS_PYPI,
        "data": ["rosbags>=0.10", "Pillow", "tqdm", "crc32c"],
        "bench": ["matplotlib", "psutil"],
        "cuda": ["pycuda", "cuda-bindings"],
        # the simulated arm (vla_sim, sim/): MuJoCo MetaWorld with its scripted experts (37 MB wheel; rendered
        # with MUJOCO_GL=egl, Mesa on a CPU). Versions measured together with numpy 2.4.
        "sim": ["metaworld==3.1.1", "mujoco==3.3.0", "gymnasium>=1.1"],
        # behaviour cloning (vla_train, train/: the only place torch is imported); torch's own build for the machine
        # (CUDA where there is a GPU). CI installs the local CPU build 2.13.0+cpu (.ci/run).
        "train": ["torch>=2.4", "rosbags>=0.10.4", "Pillow", "tqdm", "matplotlib"],
        # pytest < 8.4: on a ROS 2 install, pytest auto-loads the launch_testing and launch_pytest plugins
        # (pytest11 entry points), and Jazzy's launch_pytest 3.4 reads fixture._pytestfixturefunction, which
        # pytest 8.4 removed (ros2/launch#947); pytest 9 also drops the py.path `path` hook argument that
        # launch_testing's pytest_pycollect_makemodule takes. Ubuntu 24.04's python3-pytest is 7.4.4.
        # rosbags >= 0.10.4: the Jazzy typestore and rosbag2 metadata version 9 that oxe_to_bag writes.
        "test": ["pytest>=7.4,<8.4", "pytest-timeout", "hypothesis", "safetensors>=0.4", "rosbags>=0.10.4",
                 "Pillow", "tqdm", "crc32c", "matplotlib", "psutil",
                 # the sim extra: CI runs the closed loop
                 "metaworld==3.1.1", "mujoco==3.3.0", "gymnasium>=1.1"],
    },
    zip_safe=True,
    maintainer="vla_edge_ros developers",
    maintainer_email="vla-edge-ros@example.com",
    description="Vision-language-action inference under a hard control deadline, as ROS 2 nodes",
    license="Apache-2.0",
    tests_require=["pytest"],
    entry_points={
        "console_scripts": [
            "vla_runtime = vla_edge_ros.ros.runtime:main",
            "vla_sim = vla_edge_ros.ros.sim_node:main",
            "vla_eval = vla_edge_ros.bench.eval:main",
            "vla_sim_demos = vla_edge_ros.sim.demos:main",
            "vla_train = vla_edge_ros.train.cli:main",
            "vla_quantize = vla_edge_ros.train.quantize:main",
            "vla_camera = vla_edge_ros.ros.runtime:camera_main",
            "vla_inference = vla_edge_ros.ros.runtime:inference_main",
            "vla_action = vla_edge_ros.ros.runtime:action_main",
            "vla_test_camera = vla_edge_ros.ros.tools.test_camera:main",
            "vla_bag_replay = vla_edge_ros.ros.tools.bag_replay:main",
            "vla_action_monitor = vla_edge_ros.ros.tools.action_monitor:main",
            "oxe_to_bag = vla_edge_ros.data.oxe_to_bag:main",
            "vla_demo = vla_edge_ros.bench.demo:main",
            "vla_runtime_bench = vla_edge_ros.bench.runtime_bench:main",
            "vla_kv_bench = vla_edge_ros.bench.kv_bench:main",
            "vla_sweep = vla_edge_ros.bench.sweep:main",
            "vla_soak = vla_edge_ros.bench.soak:main",
            "vla_gpu_chunk_bench = vla_edge_ros.bench.gpu_chunk_bench:main",
            "vla_pdl_hop_bench = vla_edge_ros.bench.pdl_hop_bench:main",
        ],
    },
)
