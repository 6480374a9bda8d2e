#!/usr/bin/env bash
# The closed-loop eval (vla_eval: vla_sim + vla_runtime as real ROS 2 processes, wall-clock time) on the GPU
# machine, many runs side by side: issue 21's "the same eval with backend:=cuda, success within noise of numpy"
# and issue 23's closed loop per weight type. Each run is one `python -m vla_edge_ros.bench.eval` over a seed range,
# in its own ROS domain; bench/eval_merge.py adds up the runs of a group into one table (merged.md).
#
#   device: bash tools/h200_eval.sh   (each call carries at most 64 MiB, so over calls on one warm machine: 1. carry
#           .whl (ROS + PyCUDA, ~51 MB): INSTALL_ONLY=1 bash tools/h200_replay.sh; 2. carry .whl_sim_a (metaworld)
#           .whl_sim_b2 (mujoco, gymnasium, zstandard, pyopengl, glfw, cloudpickle, farama: the sim wheels ROS's set
#           lacks) .gl: this script; CHUNK_CKPT=DIR RUNS=none in a third call carrying DIR (session 18: 232 s for the
#           default 18 runs of 25 episodes)
#   local : PY=.venv/bin/python EPISODES=2 SPLITS=2 CONTROL_HZ=5 DEADLINE_MS=180 RUNS="numpy-bf16-push" \
#           bash tools/h200_eval.sh --local   (this project's venv: nothing installed)
#
# RUNS: groups "<backend>-<weight_dtype>-<task>"; each group runs SPLITS seed ranges of EPISODES / SPLITS episodes
# side by side (seeds SEED_START + k EPISODES / SPLITS ...), so every group sees the same initial states. The
# timing: CONTROL_HZ (camera = control, the frame rendered right after each control step: camera_after_control),
# the deadline DEADLINE_MS, the shipped policy `metaworld_mt3` (CKPT) with its deploy settings (sliding window of
# 2 frames, 128x64 images). Env overrides: PY, OUT, PREFIX, RUNS, EPISODES, SPLITS, SEED_START, CONTROL_HZ,
# DEADLINE_MS, ACTION_HZ, CKPT, DOMAIN_BASE. Outputs under $OUT: merged.md / merged.json, eval_runs.tgz (every
# run's results, report and logs).
# CHUNK_CKPT=DIR (an H > 1 chunk policy, e.g. results/policy_h200_c4, carried): issue 22's comparison of execution
# schemes runs alongside (bench/chunk_compare.py --backend cuda, every scheme x latency cell at once, its CPU
# settings by default: push (CHUNK_TASK), the issue's five schemes (CHUNK_SCHEMES: a comma list, e.g. with
# async_receding or +int4 variants), CHUNK_HZ 5 Hz, deadline CHUNK_DEADLINE_MS 400 ms, CHUNK_EPISODES seeds per cell
# in CHUNK_SPLITS seed ranges side by side, latencies CHUNK_LATENCIES; CHUNK_BACKEND numpy for a local try):
# chunk_compare.md, .json, .png. SIM_SITE=DIR uses sim packages already installed there (e.g. by
# tools/train_policy/run.sh's .cache/dev_site on a warm machine).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
MODE=device
[ "${1:-}" = "--local" ] && MODE=local
PY=${PY:-python3}
OUT=${OUT:-/tmp/h200_eval_out}
PREFIX=${PREFIX:-/tmp/vla_ros_prefix}
DOMAIN_ID=${DOMAIN_BASE:-150}
EPISODES=${EPISODES:-50}
SPLITS=${SPLITS:-2}
SEED_START=${SEED_START:-0}
CONTROL_HZ=${CONTROL_HZ:-10}
DEADLINE_MS=${DEADLINE_MS:-90}
ACTION_HZ=${ACTION_HZ:-60}  # an integer (written as a ROS double below)
CKPT=${CKPT:-metaworld_mt3}
TASKS3="push button-press-topdown drawer-close"
DEFAULT_RUNS=""
for b in cuda numpy; do for t in $TASKS3; do DEFAULT_RUNS+="$b-bf16-$t "; done; done
for w in int8 fp8 int4; do DEFAULT_RUNS+="cuda-$w-push "; done
RUNS=${RUNS:-$DEFAULT_RUNS}
[ "$RUNS" = none ] && RUNS=""  # RUNS=none: only the chunk comparison (CHUNK_CKPT)
mkdir -p "$OUT/runs"
log() { echo "[h200_eval $(date +%T)] $*"; }
log "mode $MODE, python $($PY -c 'import sys; print(sys.version.split()[0])'), out $OUT"

# shellcheck source=tools/device_ros_env.sh
source tools/device_ros_env.sh || exit 1
$PY -c "import rclpy, metaworld, mujoco; print('imports ok: mujoco', mujoco.__version__)" || exit 1
df -h /dev/shm | tail -1 | sed 's/^/\/dev\/shm: /'
nproc | sed 's/^/cpu cores: /'

WARM=""  # compile the kernels once (PyCUDA's cache) before the runtimes start
[[ " $RUNS" == *" cuda-"* ]] && WARM="$CKPT"
[ -n "${CHUNK_CKPT:-}" ] && [ "${CHUNK_BACKEND:-cuda}" = cuda ] && WARM="$WARM metaworld_mt3 $CHUNK_CKPT"
for ck in $(printf '%s\n' $WARM | awk '!seen[$0]++'); do  # each checkpoint once (CKPT is metaworld_mt3 by default)
    log "cuda warm-up: kernels compiled, $ck loaded"
    $PY -c "
from vla_edge_ros.engine.factory import make_engine
make_engine({'backend': 'cuda', 'checkpoint': '$ck'}).close()" 2>&1 | tail -3 || exit 1
done
cc_pid=""
if [ -n "${CHUNK_CKPT:-}" ]; then
    log "chunk_compare: $CHUNK_CKPT, ${CHUNK_BACKEND:-cuda}, every cell at once"
    $PY -m vla_edge_ros.bench.chunk_compare --chunk-checkpoint "$CHUNK_CKPT" --backend "${CHUNK_BACKEND:-cuda}" --jobs 60 \
        --task "${CHUNK_TASK:-push}" ${CHUNK_SCHEMES:+--schemes "$CHUNK_SCHEMES"} \
        --episodes "${CHUNK_EPISODES:-10}" --splits "${CHUNK_SPLITS:-1}" --hz "${CHUNK_HZ:-5}" \
        --deadline "${CHUNK_DEADLINE_MS:-400}" --latencies "${CHUNK_LATENCIES:-0,100,200}" --domain-id 20 --no-progress \
        --out "$OUT/runs/chunk_compare" > "$OUT/chunk_compare.log" 2>&1 &
    cc_pid=$!
fi
per=$(( (EPISODES + SPLITS - 1) / SPLITS ))
i=0
pids=()
dirs=()
for g in $RUNS; do
    backend=${g%%-*}; rest=${g#*-}; wdtype=${rest%%-*}; task=${rest#*-}
    for ((k = 0; k < SPLITS; k++)); do
        seed=$((SEED_START + k * per)); n=$(( EPISODES - k * per < per ? EPISODES - k * per : per ))
        [ "$n" -gt 0 ] || continue
        dir="$OUT/runs/$g.s$seed"; dirs+=("$dir")
        domain=$((DOMAIN_ID + i)); i=$((i + 1))
        $PY -m vla_edge_ros.bench.eval --checkpoint "$CKPT" --tasks "$task" --episodes "$n" --seed-start "$seed" \
            --backends "$backend" --policies sliding_window --kv-budgets 0 --deadlines "$DEADLINE_MS" --latencies 0 \
            --camera-hz "$CONTROL_HZ" --control-hz "$CONTROL_HZ" --camera-after-control --image-wh 128 64 \
            --runtime-param window_frames:=2 --runtime-param "weight_dtype:=$wdtype" \
            --runtime-param "action_rate_hz:=$ACTION_HZ.0" --baselines none --no-progress \
            --domain-id "$domain" --out "$dir" > "$OUT/runs/$g.s$seed.log" 2>&1 &
        pids+=($!)
    done
done
log "${#pids[@]} runs started (${EPISODES} episodes per group in $SPLITS seed ranges, $CONTROL_HZ Hz, deadline $DEADLINE_MS ms)"
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
fails=0
for p in "${pids[@]}"; do wait "$p" || fails=$((fails + 1)); done
log "runs done, $fails with a non-zero exit"
if [ -n "$cc_pid" ]; then
    wait "$cc_pid"; log "chunk_compare exit $?"
    for f in md json png; do cp "$OUT/runs/chunk_compare/compare.$f" "$OUT/chunk_compare.$f" 2>/dev/null; done
    cat "$OUT/chunk_compare.md"
fi
RC=0
if [ "${#dirs[@]}" -gt 0 ]; then $PY -m vla_edge_ros.bench.eval_merge "$OUT" "${dirs[@]}"; RC=$?; fi
tar -czf "$OUT/eval_runs.tgz" -C "$OUT" runs && rm -rf "$OUT/runs"
exit $RC
