"""`make bench`: camera-callback cost and 30 Hz timer period error, without and with inference load.

    python -m vla_edge_ros.bench.runtime_bench [--seconds 10] [--backend auto] [--json results/runtime_bench.json]

The runtime (role all: camera, lifecycle inference and action nodes, one SingleThreadedExecutor thread each,
inference loop in its own thread) runs IN this process, so the figures are read straight from the nodes;
the 60 Hz rgb8 640x480 test camera runs as a child process (real DDS transport, shared memory). Two phases:
1. inference configured but inactive (the publisher holds): baseline of the executors alone;
2. inference active: the same figures under inference load (GIL + CPU shared with the inference thread).
Printed: camera-callback cost p50/p99 (conversion + checks + buffer write, measured inside the callback) and
timer period error p50/p99/max (|actual interval - 33.3 ms|), plus the fresh/repeat/hold split.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _phase(rt, seconds: float) -> dict:
    from vla_edge_ros.core.metrics import LatencyStats, PeriodTracker

    cam, act = rt.camera, rt.action
    cam.callback_ms = LatencyStats(1 << 16)
    act.period = PeriodTracker(act.period.nominal_ms, 1 << 16)
    ticks0 = dict(act.counts)
    rec0 = cam.stats.received
    adm0 = rt.inference.snapshot()["admitted"]
    time.sleep(seconds)
    cb = cam.callback_ms.summary()
    per = act.period.summary()
    return {
        "seconds": seconds,
        "frames": cam.stats.received - rec0,
        "camera_callback_ms": {"p50": cb["p50"], "p99": cb["p99"], "max": cb["max"], "count": cb["count"]},
        "timer_period_error_ms": {"p50": per["period_error_p50_ms"], "p99": per["period_error_p99_ms"],
                                  "max": per["period_error_max_ms"]},
        "ticks": {k: act.counts[k] - ticks0[k] for k in act.counts},
        "chunks_admitted": rt.inference.snapshot()["admitted"] - adm0,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="vla_runtime_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--json", default="", help="also write the figures here")
    a = ap.parse_args(argv)
    from vla_edge_ros.bench.procs import ros_child_env

    env = ros_child_env()
    os.environ.update(env)
    import rclpy
    from rclpy.signals import SignalHandlerOptions

    from vla_edge_ros.ros.runtime import Runtime

    camera = subprocess.Popen([sys.executable, "-m", "vla_edge_ros.ros.tools.test_camera"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    rclpy.init(args=["vla_runtime_bench", "--ros-args", "--log-level", "warn"],
               signal_handler_options=SignalHandlerOptions.NO)
    rt = Runtime("all", autostart=False, parameter_overrides={"backend": a.backend})
    rt.start()
    out = {}
    try:
        if not rt.inference.safe_transition("configure"):
            print(f"configure failed: {rt.inference.last_error}", file=sys.stderr)
            return 1
        t0 = time.monotonic()
        while rt.camera.stats.received < 30 and time.monotonic() - t0 < 30:
            time.sleep(0.1)
        time.sleep(1.0)
        out["idle"] = _phase(rt, a.seconds)
        rt.inference.safe_transition("activate")
        time.sleep(1.0)
        out["inference_load"] = _phase(rt, a.seconds)
        out["backend"] = rt.inference.backend
        out["cpu_count"] = os.cpu_count()
        out["load_avg"] = list(os.getloadavg())
    finally:
        rt.stop()
        rt.destroy()
        rclpy.try_shutdown()
        camera.send_signal(signal.SIGINT)
        try:
            camera.wait(10)
        except subprocess.TimeoutExpired:
            camera.kill()
    print(f"runtime_bench ({out['backend']} backend, {out['cpu_count']} CPUs, load avg {out['load_avg'][0]:.2f}; "
          f"60 Hz rgb8 640x480 camera; {a.seconds:.0f} s per phase)")
    print(f"{'phase':<16}{'frames':>8}{'cam cb p50':>12}{'cam cb p99':>12}{'timer err p50':>15}"
          f"{'timer err p99':>15}{'timer err max':>15}  ticks fresh/repeat/hold  chunks")
    for name in ("idle", "inference_load"):
        r = out[name]
        c, t = r["camera_callback_ms"], r["timer_period_error_ms"]
        print(f"{name:<16}{r['frames']:>8}{c['p50']:>10.3f}ms{c['p99']:>10.3f}ms{t['p50']:>13.3f}ms{t['p99']:>13.3f}ms"
              f"{t['max']:>13.3f}ms  {r['ticks']['fresh']}/{r['ticks']['repeat']}/{r['ticks']['hold']}"
              f"{r['chunks_admitted']:>10}")
    load = out["inference_load"]
    print(f"camera-callback cost p99 under inference load: {load['camera_callback_ms']['p99']:.3f} ms")
    print(f"30 Hz timer period error p99 under inference load: {load['timer_period_error_ms']['p99']:.3f} ms")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
