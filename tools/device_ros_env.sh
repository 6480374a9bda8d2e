# Sourced (not run) by tools/h200_replay.sh and tools/h200_eval.sh: ROS 2 Jazzy, PyCUDA and, when carried, the
# MetaWorld sim on a machine that has none of them (the GPU machine: Python 3.12, no registry), from wheels.
#
# Inputs (git-ignored): .whl/*.whl (PyCUDA + deps), .whl/ros/*.whl (ROS 2 Jazzy + rosbags, cp312: how to fill it
# is in tools/h200_replay.sh), optionally .whl/extra/pillow-*.whl, .whl_sim .whl_sim_* (metaworld, mujoco,
# gymnasium...: tools/train_policy/README.md) and .gl/*.deb (the EGL loader: ../shared/device/README.md).
# Each part installs once per machine (markers under PREFIX / SIM_SITE): a warm machine keeps them between calls, so
# parts too big for one call's 64 MiB travel in separate calls (ROS in one, the sim in the next).
# Needs: PY, PREFIX, DOMAIN_ID and a log function. Sets: PYTHONPATH (ROS site, the checkout, SIM_SITE),
# LD_LIBRARY_PATH, AMENT_PREFIX_PATH, the RMW / Fast DDS / discovery settings, a fresh ROS_HOME, MUJOCO_GL=egl.
#
# Why `pip install --prefix` and not `--target` for ROS: the ros_* wheels put their C libraries (librcl.so, the
# message typesupport libraries...) in the wheel's data/lib, which `--target` silently drops. With --prefix they
# land in $PREFIX/lib; LD_LIBRARY_PATH then gets that folder and the wheels' bundled ros_*.libs folders -- what
# ros_wheels_bootstrapper.pth does in a venv (a .pth file is not processed from PYTHONPATH). The sim wheels keep
# their libraries inside the package (mujoco), so `--target` suffices there.
SIM_SITE=${SIM_SITE:-/tmp/vla_sim_site}
if $PY -c "import rclpy" 2>/dev/null; then  # a ROS 2 environment already (this project's venv): nothing to install
    log "rclpy importable by $PY: using that environment"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" RMW_IMPLEMENTATION=rmw_fastrtps_cpp
    export FASTRTPS_DEFAULT_PROFILES_FILE="$PWD/config/fastdds_profile.xml" ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST
    export ROS_DOMAIN_ID=$DOMAIN_ID OPENBLAS_NUM_THREADS=1 PYTHONUNBUFFERED=1 MUJOCO_GL=egl
    ROS_HOME=$(mktemp -d /tmp/vla_ros_home.XXXXXX)
    export ROS_HOME ROS_LOG_DIR="$ROS_HOME/log"
    unset ROS_LOCALHOST_ONLY
    return 0
fi
if [ ! -f "$PREFIX/.installed" ]; then
    ls .whl/ros/*.whl >/dev/null 2>&1 || { log "no .whl/ros/*.whl and nothing installed under $PREFIX"; return 1; }
    log "pip install --prefix $PREFIX (ROS 2 + PyCUDA wheels)"
    # --ignore-installed: a PyCUDA already importable (a --target site on PYTHONPATH, as the GPU tests install it)
    # would otherwise be skipped here, and the replays' fresh environment would not find it
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --no-warn-script-location \
        --ignore-installed --prefix "$PREFIX" .whl/*.whl .whl/ros/*.whl || { log "pip install failed"; return 1; }
    if ! $PY -c "import PIL" 2>/dev/null; then
        log "PIL missing: installing .whl/extra/pillow"
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --prefix "$PREFIX" \
            .whl/extra/pillow-*.whl || { log "pillow install failed"; return 1; }
    fi
    touch "$PREFIX/.installed"
fi
for d in .whl_sim .whl_sim_*; do
    [ -d "$d" ] && [ ! -f "$SIM_SITE/.installed_$d" ] || continue
    log "pip install --target $SIM_SITE ($d)"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --no-warn-script-location \
        --target "$SIM_SITE" "$d"/*.whl || { log "pip install of $d failed"; return 1; }
    touch "$SIM_SITE/.installed_$d"
done
if [ -d .gl ] && [ "$(id -u)" = 0 ]; then  # the EGL loader (device: root, a bare image); locally Mesa is there
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
    [ -f /usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json ] && \
        export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
fi
RCLPY_DIR=$(find "$PREFIX" -maxdepth 6 -type d -name rclpy -path '*-packages/rclpy' | head -1)
LIBRCL=$(find "$PREFIX" -maxdepth 4 -name librcl.so | head -1)
[ -n "$RCLPY_DIR" ] && [ -n "$LIBRCL" ] || { log "rclpy / librcl.so not found under $PREFIX"; return 1; }
SITE=$(dirname "$RCLPY_DIR")
RLIBS=$(ls -d "$SITE"/ros_*.libs | paste -sd: -)
export PYTHONPATH="$SITE:$PWD${SIM_SITE:+:$SIM_SITE}${PYTHONPATH:+:$PYTHONPATH}"
export LD_LIBRARY_PATH="$(dirname "$LIBRCL"):$RLIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export AMENT_PREFIX_PATH="$PREFIX" _ROS_WHEELS_BOOTSTRAP_COMPLETE=1
export RMW_IMPLEMENTATION=rmw_fastrtps_cpp FASTRTPS_DEFAULT_PROFILES_FILE="$PWD/config/fastdds_profile.xml"
export ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST ROS_DOMAIN_ID=$DOMAIN_ID OPENBLAS_NUM_THREADS=1 PYTHONUNBUFFERED=1
export MUJOCO_GL=egl
ROS_HOME=$(mktemp -d /tmp/vla_ros_home.XXXXXX)
export ROS_HOME ROS_LOG_DIR="$ROS_HOME/log"
unset ROS_LOCALHOST_ONLY
[ -d /usr/local/cuda/bin ] && export PATH="$PATH:/usr/local/cuda/bin"
return 0
