#!/usr/bin/env bash
# One edge serving a fleet (issue 24) on a GPU machine without ROS: vla_edge_ros.bench.fleet_replay with ONE
# `vla_runtime --role edge` (backend cuda, the random-weight Qwen2.5-1.5B-geometry checkpoint of
# tools/h200_replay.sh), ROBOTS `--role robot` processes and ROBOTS bag replays at 60 Hz, for DURATION s.
# Acceptance (issue 24): every robot's deadline-miss rate <= 0.1 %, every robot gets fresh actions; the table
# also gives each robot's fresh share and KV bytes (its VRAM), the weights and the batch sizes.
#
#   device:  bash tools/h200_fleet_replay.sh            (files under $OUT; needs .whl/ carried along)
#            EDGE_PARAMS="cost_quantile:=0.95" OUT=/tmp/fleet_q95 bash tools/h200_fleet_replay.sh   (another -p)
#   local :  PY=.venv/bin/python bash tools/h200_fleet_replay.sh --local
#            (numpy backend, the tiny default model, 3 robots, 15 s, deadline 100 ms, kv_budget_tokens 128: a
#            2-core machine cannot serve 3 robots in 33 ms; test/test_fleet_ros.py uses the same values)
#
# Install, import checks and the checkpoint: tools/h200_replay.sh with INSTALL_ONLY=1 (the same wheels under
# .whl/, the same PREFIX and CKPT: a warm machine keeps them between calls), then tools/device_ros_env.sh for
# this script's own environment.
# Env overrides: PY, OUT, DURATION (s measured), ROBOTS, CAMERA_HZ, PREFIX, DOMAIN_ID, BAG, CKPT, WEIGHT_DTYPE,
# DEADLINE_MS, KV_BUDGET (tokens per robot; default: the registry's), STARTUP_TIMEOUT (s), EDGE_PARAMS (more edge
# parameters, space-separated NAME:=VALUE, each passed as -p; e.g. EDGE_PARAMS="cost_quantile:=0.95"),
# SYNTHETIC_SIZE (HxW: a synthetic clip of that frame size instead of BAG, e.g. 480x640), IMAGE_TRANSPORT
# (raw: the replays publish decoded rgb8 Images, the default; compressed: the JPEGs, decoded by the edge),
# EDGE_STATS_EVERY_S (the edge's stats file period; fleet_replay's default 2 s), SETTLE_S (s of frames flowing
# before the window opens, --settle-s: the replays' start-up; its late chunks are reported on their own line),
# PYSPY_S (s: sample every thread of the edge with py-spy for that long, PYSPY_AFTER_S (default 60) s after the edge
# process appears; PYSPY_FLAGS: default --idle, "--gil" samples only the GIL's holder; raw stacks in
# $OUT/edge_pyspy.txt, per-thread leaves in $OUT/edge_pyspy_summary.txt by vla_edge_ros.bench.stack_summary; py-spy
# from PATH, its wheel under .whl/tools/ (pip download py-spy -d .whl/tools) or its binary as .whl/tools/py-spy.xz).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
MODE=device
[ "${1:-}" = "--local" ] && MODE=local
PY=${PY:-python3}
OUT=${OUT:-/tmp/h200_fleet_replay_out}
PREFIX=${PREFIX:-/tmp/vla_ros_prefix}
DOMAIN_ID=${DOMAIN_ID:-58}
BAG=${BAG:-.whl/bag/bridge}
CKPT=${CKPT:-/tmp/qwen2_5_1_5b_random}
CAMERA_HZ=${CAMERA_HZ:-60}
STARTUP_TIMEOUT=${STARTUP_TIMEOUT:-420}
if [ "$MODE" = device ]; then
    DURATION=${DURATION:-120}; ROBOTS=${ROBOTS:-8}; DEADLINE_MS=${DEADLINE_MS:-}; KV_BUDGET=${KV_BUDGET:-}
else
    DURATION=${DURATION:-15}; ROBOTS=${ROBOTS:-3}; DEADLINE_MS=${DEADLINE_MS:-100}; KV_BUDGET=${KV_BUDGET:-128}
fi
mkdir -p "$OUT"
log() { echo "[h200_fleet_replay $(date +%T)] $*"; }
log "mode $MODE, $ROBOTS robots, $DURATION s at $CAMERA_HZ Hz, out $OUT"

# ---- install, checks, checkpoint: h200_replay.sh's own steps, then its environment ---------------------------
LOCAL_FLAG=()
[ "$MODE" = local ] && LOCAL_FLAG=(--local)
if ! INSTALL_ONLY=1 OUT="$OUT/setup" PY=$PY PREFIX=$PREFIX DOMAIN_ID=$DOMAIN_ID BAG=$BAG CKPT=$CKPT \
        bash tools/h200_replay.sh "${LOCAL_FLAG[@]}"; then
    log "install / checks / checkpoint failed (see $OUT/setup)"
    exit 1
fi
# shellcheck source=tools/device_ros_env.sh
source tools/device_ros_env.sh || exit 1

ARGS=(--robots "$ROBOTS" --duration "$DURATION" --camera-hz "$CAMERA_HZ" --domain-id "$DOMAIN_ID"
      --startup-timeout "$STARTUP_TIMEOUT" --out "$OUT/fleet")
if [ "$MODE" = device ]; then ARGS+=(--backend cuda --checkpoint "$CKPT"); else ARGS+=(--backend numpy); fi
if [ -n "${SYNTHETIC_SIZE:-}" ]; then ARGS+=(--synthetic-size "$SYNTHETIC_SIZE")
elif [ -e "$BAG" ]; then ARGS+=(--bag "$BAG"); fi
[ -n "${IMAGE_TRANSPORT:-}" ] && ARGS+=(--image-transport "$IMAGE_TRANSPORT")
for p in ${EDGE_PARAMS:-}; do ARGS+=(--param "$p"); done
[ -n "$DEADLINE_MS" ] && ARGS+=(--deadline-ms "$DEADLINE_MS")
[ -n "$KV_BUDGET" ] && ARGS+=(--kv-budget-tokens "$KV_BUDGET")
[ -n "${WEIGHT_DTYPE:-}" ] && ARGS+=(--weight-dtype "$WEIGHT_DTYPE")
[ -n "${EDGE_STATS_EVERY_S:-}" ] && ARGS+=(--edge-stats-every-s "$EDGE_STATS_EVERY_S")
[ -n "${SETTLE_S:-}" ] && ARGS+=(--settle-s "$SETTLE_S")

# ---- the replay ---------------------------------------------------------------------------------------------
SMI_PID=""
if [ "$MODE" = device ]; then
    nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 5 > "$OUT/smi_timeline.csv" 2>&1 &
    SMI_PID=$!
fi
pyspy_bin() {  # py-spy on PATH, else from the carried wheel, else from its binary xz-compressed (.whl/tools/py-spy.xz:
    # 2.0 of the wheel's 2.9 MB, what fits the device's 64 MiB of carried files next to the ROS wheels and the bag)
    command -v py-spy && return 0
    local w
    w=$(ls .whl/tools/py_spy-*.whl 2>/dev/null | head -1)
    [ -n "$w" ] && $PY -m pip install -q --no-index --no-deps --target /tmp/pyspy "$w" > /dev/null 2>&1
    if [ ! -x /tmp/pyspy/bin/py-spy ] && [ -f .whl/tools/py-spy.xz ]; then
        mkdir -p /tmp/pyspy/bin && $PY -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), \
open(sys.argv[2], 'wb'))" .whl/tools/py-spy.xz /tmp/pyspy/bin/py-spy && chmod +x /tmp/pyspy/bin/py-spy
    fi
    [ -x /tmp/pyspy/bin/py-spy ] && echo /tmp/pyspy/bin/py-spy
}
PYSPY_PID=""
if [ -n "${PYSPY_S:-}" ]; then
    if SPY=$(pyspy_bin); then
        (   EPID=""
            for _ in $(seq 1 "$STARTUP_TIMEOUT"); do
                EPID=$(pgrep -f -- "--role edge" | head -1)
                [ -n "$EPID" ] && break
                sleep 1
            done
            [ -z "$EPID" ] && { echo "no edge process found" > "$OUT/edge_pyspy.log"; exit 0; }
            sleep "${PYSPY_AFTER_S:-60}"
            # not paused while sampled (--nonblocking): the stalls being looked for are a few ms to tens of ms;
            # PYSPY_FLAGS="--gil": only the thread holding the GIL in each sample (who keeps the others waiting)
            # shellcheck disable=SC2086
            "$SPY" record --pid "$EPID" --duration "$PYSPY_S" --rate 200 --threads ${PYSPY_FLAGS:---idle} --native \
                --nonblocking --format raw --output "$OUT/edge_pyspy.txt" > "$OUT/edge_pyspy.log" 2>&1 \
            || "$SPY" record --pid "$EPID" --duration "$PYSPY_S" --rate 200 --threads ${PYSPY_FLAGS:---idle} \
                --nonblocking --format raw --output "$OUT/edge_pyspy.txt" >> "$OUT/edge_pyspy.log" 2>&1
        ) &
        PYSPY_PID=$!
    else
        log "PYSPY_S set but no py-spy (PATH or .whl/tools/py_spy-*.whl): not profiling"
    fi
fi
log "fleet_replay ${ARGS[*]}"
timeout --signal=INT --kill-after=60 $((DURATION + STARTUP_TIMEOUT + 240)) \
    $PY -m vla_edge_ros.bench.fleet_replay "${ARGS[@]}" 2>&1 | tee "$OUT/fleet_replay.log"
RC=${PIPESTATUS[0]}
[ -n "$SMI_PID" ] && kill "$SMI_PID" 2>/dev/null
if [ -n "$PYSPY_PID" ]; then
    wait "$PYSPY_PID"
    if [ -s "$OUT/edge_pyspy.txt" ]; then
        $PY -m vla_edge_ros.bench.stack_summary "$OUT/edge_pyspy.txt" > "$OUT/edge_pyspy_summary.txt" 2>&1
        head -60 "$OUT/edge_pyspy_summary.txt"
    else
        log "py-spy wrote nothing: $(tail -3 "$OUT/edge_pyspy.log" 2>/dev/null)"
    fi
fi
log "fleet_replay exit code $RC"
# the device returns few files from $OUT: the table and JSON beside the log, the logs as one archive
for f in fleet_replay.md fleet_replay.json; do [ -f "$OUT/fleet/$f" ] && cp "$OUT/fleet/$f" "$OUT/$f"; done
tar -czf "$OUT/fleet_logs.tgz" -C "$OUT" fleet setup 2>/dev/null && rm -rf "$OUT/fleet" "$OUT/setup"
exit "$RC"
