#!/usr/bin/env bash
# The runtime (vla_runtime + vla_bag_replay, through vla_edge_ros.bench.sweep) on a GPU machine without ROS:
# 'semantic' policy, 'nominal' setting, camera re-timed to 60 Hz, looped, backend cuda, a random-weight
# Qwen2.5-1.5B-geometry checkpoint generated here (no weights can be downloaded). Acceptance: the admission
# controller admits chunks and <= 0.1 % of admitted chunks miss the deadline over a 2-minute replay.
#
#   device:  bash tools/h200_replay.sh            (files under $OUT; needs .whl/ carried along)
#   local :  PY=python3.12 bash tools/h200_replay.sh --local   (numpy backend, tiny model, 10 s)
#
# Inputs (git-ignored .whl/): .whl/*.whl (PyCUDA + deps), .whl/ros/*.whl (ROS 2 Jazzy + rosbags, cp312),
# .whl/extra/pillow-*.whl (used only when PIL is missing: vla_bag_replay decodes the JPEG frames),
# .whl/bag/bridge (the Bridge sample converted here beforehand:
#   python -m vla_edge_ros.data.oxe_to_bag ../shared/data/oxe .whl/bag/bridge; without it the sweep replays
#   its synthetic clip).
# Filling .whl/ on a machine with the registries (the GPU machine has none): PyCUDA + deps from
#   ../shared/device/wheels; the ROS wheels for the device's Python 3.12, one by one without dependencies (the
#   build-time rosidl/ament packages have no cp312 wheels of their dependencies), e.g.
#   for p in $(pip freeze | grep -i '^ros-'); do pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux_2_28_x86_64 -d .whl/ros "$p"; done   (+ rosbags, ruamel.yaml, lz4, backports.zstd,
#   apsw, pyyaml, psutil, typing_extensions the same way); the device allows 64 MiB of carried files (~57 MiB).
# Env overrides: PY, OUT, DURATION (s of replay), PREFIX (install prefix), DOMAIN_ID, BAG, CKPT, WEIGHT_DTYPE
# (bf16 | int8 | fp8 | int4: the runtime quantises the bf16 checkpoint at load; issue 23).
#
# Installation and environment: tools/device_ros_env.sh. INSTALL_ONLY=1: install, check, write the checkpoint,
# then stop (a warm machine keeps all three for the next call).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
MODE=device
[ "${1:-}" = "--local" ] && MODE=local
PY=${PY:-python3}
OUT=${OUT:-/tmp/h200_replay_out}
PREFIX=${PREFIX:-/tmp/vla_ros_prefix}
DOMAIN_ID=${DOMAIN_ID:-57}
BAG=${BAG:-.whl/bag/bridge}
CKPT=${CKPT:-/tmp/qwen2_5_1_5b_random}
if [ "$MODE" = device ]; then DURATION=${DURATION:-120}; else DURATION=${DURATION:-10}; fi
mkdir -p "$OUT"
log() { echo "[h200_replay $(date +%T)] $*"; }
log "mode $MODE, python $($PY -c 'import sys; print(sys.version.split()[0])'), duration $DURATION s, out $OUT"

# ---- install (once per machine) and environment: tools/device_ros_env.sh -----------------------------------
# shellcheck source=tools/device_ros_env.sh
source tools/device_ros_env.sh || exit 1

# ---- checks ---------------------------------------------------------------------------------------------
log "import check"
$PY - <<'EOF' 2>&1 | tee "$OUT/env_check.txt" || { log "import check failed"; exit 1; }
import rclpy, sensor_msgs.msg, rosbags, yaml, psutil, PIL, numpy
rclpy.init()
n = rclpy.create_node("h200_replay_check")
n.destroy_node()
rclpy.shutdown()
print("rclpy ok; numpy", numpy.__version__, "PIL", PIL.__version__, "rosbags", list(rosbags.__path__))
EOF
df -h /dev/shm | tail -1 | sed 's/^/\/dev\/shm: /'
if [ "$MODE" = device ]; then
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv | tee "$OUT/smi.txt"
    $PY -c "import pycuda.driver as d; d.init(); print('pycuda ok:', d.Device(0).name()); \
import shutil; print('nvcc:', shutil.which('nvcc'))" 2>&1 | tee -a "$OUT/env_check.txt" || exit 1
fi
if [ -e "$BAG" ]; then BAG_ARGS=(--bag "$BAG"); log "bag $BAG ($(du -sh "$BAG" | cut -f1))"
else BAG_ARGS=(); log "no $BAG: the sweep's default clip"; fi

# ---- checkpoint (device): Qwen2.5-1.5B geometry, random bf16 weights, no vision tensors (seeded init) --------
if [ "$MODE" = device ]; then
    BACKEND_ARGS=(--backend cuda --checkpoint "$CKPT")
    if [ ! -f "$CKPT/model.safetensors" ]; then
        log "writing random-weight checkpoint to $CKPT"
        $PY - "$CKPT" <<'EOF' 2>&1 | tee "$OUT/checkpoint.log" || { log "checkpoint generation failed"; exit 1; }
import json, sys, time
from pathlib import Path
import torch
from safetensors.torch import save_file
from vla_edge_ros.bench.gpu_chunk_bench import random_weights
from vla_edge_ros.engine.config import ModelConfig, qwen2_5_1_5b_dict
t0 = time.time()
path = Path(sys.argv[1])
cfg_dict = qwen2_5_1_5b_dict()
tensors = random_weights(torch, ModelConfig.from_json(cfg_dict), seed=1)
path.mkdir(parents=True, exist_ok=True)
(path / "config.json").write_text(json.dumps(cfg_dict, indent=2))
save_file({k: v.cpu() for k, v in tensors.items()}, str(path / "model.safetensors"))
n = sum(v.numel() for v in tensors.values())
print(f"checkpoint {path}: {len(tensors)} tensors, {n / 1e9:.3f} B params, "
      f"{(path / 'model.safetensors').stat().st_size / 2**30:.2f} GiB, {time.time() - t0:.1f} s")
print("config:", json.dumps(cfg_dict))
EOF
        $PY -c "import torch; torch.cuda.empty_cache()" >/dev/null 2>&1
    fi
else
    BACKEND_ARGS=(--backend numpy)
fi

[ "${INSTALL_ONLY:-0}" = 1 ] && { log "installed (and the checkpoint written) only"; exit 0; }

# ---- the replay ---------------------------------------------------------------------------------------------
SMI_PID=""
if [ "$MODE" = device ]; then
    nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 5 > "$OUT/smi_timeline.csv" 2>&1 &
    SMI_PID=$!
fi
[ -n "${WEIGHT_DTYPE:-}" ] && BACKEND_ARGS+=(--weight-dtype "$WEIGHT_DTYPE")
log "sweep: ${BACKEND_ARGS[*]} ${BAG_ARGS[*]} --duration $DURATION"
timeout --signal=INT --kill-after=30 $((DURATION + 240)) $PY - --duration "$DURATION" "${BAG_ARGS[@]}" \
    "${BACKEND_ARGS[@]}" --policies semantic --settings nominal --domain-id "$DOMAIN_ID" \
    --out "$OUT/sweep" <<'EOF' 2>&1 | tee "$OUT/sweep.log"
import sys
from vla_edge_ros.bench import sweep
try:
    import matplotlib  # noqa: F401
except ImportError:  # the figures are in report.md / semantic.json; only the plots need matplotlib
    print("vla_sweep: matplotlib missing, plots skipped", file=sys.stderr)
    sweep.make_plots = lambda results, out: []
sys.exit(sweep.main(sys.argv[1:]))
EOF
RC=${PIPESTATUS[0]}
[ -n "$SMI_PID" ] && kill "$SMI_PID" 2>/dev/null
log "sweep exit code $RC"

# ---- summary --------------------------------------------------------------------------------------------
$PY - "$OUT/sweep/semantic.json" "$OUT/sweep/logs/nominal_semantic.stats.json" <<'EOF' 2>&1 | tee "$OUT/summary.txt"
import json, sys
r = json.load(open(sys.argv[1]))["settings"]["nominal"]
try:
    st = json.load(open(sys.argv[2]))
except OSError:
    st = {}
c, lat, t, f, m = r["chunks"], r["latency_ms"], r["ticks"], r["frames"], r["memory"]
pct = lambda x: "n/a" if x is None else f"{100 * x:.3f} %"
print(f"weight_dtype {r['params'].get('weight_dtype', 'bf16')}, backend {r['backend']}, active {r['duration_s']} s, runtime exit {r['runtime_exit_code']}, error {r['error']}")
print(f"chunks admitted / refused / deadline misses: {c['admitted']} / {c['refused']} / {c['deadline_misses']}"
      f"  (miss {pct(r['deadline_miss_rate'])}, refused {pct(r['refusal_rate'])})")
print(f"chunk latency p50 / p95 / p99 / max ms: {lat['p50']} / {lat['p95']} / {lat['p99']} / {lat['max']}")
print(f"ticks fresh / repeat / hold: {t['fresh']} / {t['repeat']} / {t['hold']} (total {sum(t.values())}); "
      f"fresh {pct(r['fresh_rate'])}, repeat {pct(r['fallback_rate'])}, hold {pct(r['hold_rate'])}")
print(f"frames published / received / overwritten / rejected: {f['published_by_replay']} / {f['received']} / "
      f"{f['overwritten_before_inference']} / {f['rejected']}")
print(f"timer period error ms: {st.get('timer_period_error_ms')}")
print(f"peak RSS {m['peak_rss_mb']} MB, peak VRAM {m['peak_vram_mb']} MB; kv {r['kv']}; replay {r['replay']}")
ok = r["error"] is None and c["admitted"] > 0 and (r["deadline_miss_rate"] or 0.0) <= 0.001
print("ACCEPTANCE (admitted > 0, misses <= 0.1 %):", "MET" if ok else "NOT MET")
EOF
# the device returns at most 8 files from $OUT: the sweep folder travels back as one archive
[ -f "$OUT/sweep/report.md" ] && cp "$OUT/sweep/report.md" "$OUT/report.md"
tar -czf "$OUT/sweep.tgz" -C "$OUT" sweep && rm -rf "$OUT/sweep"
exit "$RC"
