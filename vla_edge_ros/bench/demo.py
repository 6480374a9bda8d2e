"""`make demo`: the whole pipeline on the embedded default model for DURATION seconds.

    python -m vla_edge_ros.bench.demo --duration 20 --policy semantic --out results/demo.json

Starts two child processes -- ``vla_test_camera`` (60 Hz rgb8 640x480 moving pattern) and ``vla_runtime``
(role all: camera subscriber, lifecycle inference node brought to active, 30 Hz action publisher) -- and watches
them from this process as an ordinary ROS consumer would: it subscribes the action stream (JointState, kind in
header.frame_id) and /diagnostics, and prints a one-line summary each second. At the end it stops the runtime with
SIGINT (the runtime writes its own figures with --stats-out), prints a summary table and writes the JSON.

Why child processes rather than threads in this process: the camera then crosses a real DDS transport exactly
like a camera driver's images would (shared memory with config/fastdds_profile.xml), its 60 Hz image generation
does not compete for the runtime's GIL, and what is measured is the executable an operator runs (`vla_runtime`),
including its SIGINT shutdown.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

# ros_child_env stays importable from here (vla_edge_ros/bench/runtime_bench.py uses it)
from vla_edge_ros.bench.procs import ROOT, Child, ros_child_env


class Watcher:
    """The demo's own ROS node: counts action kinds per second and keeps the latest /diagnostics values."""

    def __init__(self, action_topic: str = "/vla/action"):
        import rclpy
        from diagnostic_msgs.msg import DiagnosticArray
        from rclpy.executors import SingleThreadedExecutor
        from sensor_msgs.msg import JointState

        from vla_edge_ros.ros import qos

        self.rclpy = rclpy
        rclpy.init(args=[])
        self.node = rclpy.create_node("vla_demo_watcher")
        self.lock = threading.Lock()
        self.kinds = {"fresh": 0, "repeat": 0, "hold": 0, "other": 0}
        self.diag: dict[str, dict[str, str]] = {}
        self.diag_msgs = 0
        self.node.create_subscription(JointState, action_topic, self._on_action, qos.reliable_qos(50))
        self.node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diag, qos.reliable_qos(10))
        self.ex = SingleThreadedExecutor()
        self.ex.add_node(self.node)
        self.thread = threading.Thread(target=self.ex.spin, daemon=True)
        self.thread.start()

    def _on_action(self, msg) -> None:
        k = msg.header.frame_id if msg.header.frame_id in self.kinds else "other"
        with self.lock:
            self.kinds[k] += 1

    def _on_diag(self, msg) -> None:
        with self.lock:
            self.diag_msgs += 1
            for st in msg.status:
                self.diag[st.name] = {kv.key: kv.value for kv in st.values} | {"_message": st.message}

    def snapshot(self) -> tuple[dict, dict]:
        with self.lock:
            return dict(self.kinds), {k: dict(v) for k, v in self.diag.items()}

    def close(self) -> None:
        self.ex.shutdown(timeout_sec=2.0)
        self.thread.join(timeout=2.0)
        self.node.destroy_node()
        self.rclpy.try_shutdown()


def _f(d: dict, key: str, default: float = math.nan) -> float:
    try:
        return float(d.get(key, default))
    except (TypeError, ValueError):
        return default


def live_line(t: float, kinds: dict, prev: dict, diag: dict) -> str:
    inf = diag.get("vla_inference: engine", {})
    cam = diag.get("vla_camera: ingest", {})
    act = diag.get("vla_action: publisher", {})
    d = {k: kinds[k] - prev.get(k, 0) for k in ("fresh", "repeat", "hold")}
    return (f"t={t:5.1f}s  ticks/s fresh {d['fresh']:2d} repeat {d['repeat']:2d} hold {d['hold']:2d} | "
            f"chunks ok {inf.get('chunks_admitted', '-')} refused {inf.get('chunks_refused', '-')} "
            f"miss {inf.get('deadline_misses', '-')} | p99 {_f(inf, 'latency_ms_p99'):.1f} ms | "
            f"frames {cam.get('frames_received', '-')} drop {cam.get('frames_dropped', '-')} "
            f"rej {cam.get('frames_rejected', '-')} | KV {inf.get('kv_occupancy_tokens', '-')}/"
            f"{inf.get('kv_budget_tokens', '-')} {inf.get('kv_policy', '-')} | "
            f"timer p99 {_f(act, 'timer_period_error_ms_p99'):.2f} ms | {inf.get('state', 'starting')}")


def summary_table(res: dict) -> str:
    rows = [
        ("backend", res.get("backend")),
        ("duration_s", f"{res['duration_s']:.1f}"),
        ("ticks fresh / repeat / hold", "{fresh} / {repeat} / {hold}".format(**res["ticks"])),
        ("fresh share of ticks", f"{res['fresh_fraction']:.1%}"),
        ("chunks admitted / refused / deadline misses",
         "{admitted} / {refused} / {deadline_misses}".format(**res["chunks"])),
        ("chunk latency p50 / p95 / p99 (ms)", " / ".join(_num(res["latency_ms"][k]) for k in ("p50", "p95", "p99"))),
        ("timer period error p50 / p99 (ms)",
         " / ".join(_num(res["timer_period_error_ms"][k]) for k in ("p50", "p99"))),
        ("frames received / dropped / rejected", "{received} / {dropped} / {rejected}".format(**res["frames"])),
        ("KV policy / budget / max occupancy (tokens)",
         "{policy} / {budget_tokens} / {max_occupancy_tokens}".format(**res["kv"])),
        ("peak RSS / peak VRAM (MiB)", f"{_num(res['memory']['peak_rss_mb'])} / {_num(res['memory']['peak_vram_mb'])}"),
        ("actions seen by a subscriber (fresh/repeat/hold)",
         "{fresh} / {repeat} / {hold}".format(**res["subscriber_ticks"])),
    ]
    w = max(len(r[0]) for r in rows)
    line = "-" * (w + 30)
    return "\n".join([line] + [f"{k:<{w}}  {v}" for k, v in rows] + [line])


def _num(x: Any) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{float(x):.2f}"


def build_result(stats: dict, subscriber: dict, args: argparse.Namespace) -> dict:
    ticks = stats.get("ticks", {"fresh": 0, "repeat": 0, "hold": 0})
    total = max(1, sum(ticks.values()))
    return {
        "backend": stats.get("backend"),
        "duration_s": stats.get("duration_s"),
        "ticks": ticks,
        "fresh_fraction": ticks.get("fresh", 0) / total,
        "chunks": stats.get("chunks", {}),
        "latency_ms": stats.get("latency_ms", {}),
        "timer_period_error_ms": stats.get("timer_period_error_ms", {}),
        "frames": {k: stats.get("frames", {}).get(k) for k in ("received", "dropped", "rejected")},
        "kv": stats.get("kv", {}),
        "memory": stats.get("memory", {}),
        "subscriber_ticks": {k: subscriber.get(k, 0) for k in ("fresh", "repeat", "hold")},
        "frame_to_action_ms": stats.get("inference", {}).get("frame_to_action_ms"),
        "missed_ticks": stats.get("action", {}).get("missed_ticks"),
        "config": {"policy": args.policy, "requested_backend": args.backend, "checkpoint": args.checkpoint,
                   "params": list(args.param),
                   "camera": "vla_test_camera 60 Hz rgb8 640x480", "cpu_count": os.cpu_count(),
                   "load_avg_at_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None},
    }


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="vla_demo", description="run the runtime on the tiny default and report")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of control after inference is active")
    ap.add_argument("--policy", default="semantic", help="eviction_policy (semantic | fifo | sliding_window)")
    ap.add_argument("--backend", default="auto", help="auto | cuda | numpy")
    ap.add_argument("--checkpoint", default="", help="checkpoint directory (empty: embedded tiny default)")
    ap.add_argument("--param", action="append", default=[], metavar="NAME:=VALUE",
                    help="extra runtime parameter (repeatable), e.g. --param kv_budget_tokens:=1024")
    ap.add_argument("--out", default="results/demo.json")
    ap.add_argument("--startup-timeout", type=float, default=120.0, help="max seconds to reach 'active'")
    args = ap.parse_args(argv)
    from vla_edge_ros import params as registry

    for name, value in (("eviction_policy", args.policy), ("backend", args.backend)):
        why = registry.validate(name, value)
        if why:
            print(f"vla_demo: {why}", file=sys.stderr)
            return 2

    workdir = Path(tempfile.mkdtemp(prefix="vla_demo_"))
    env = ros_child_env(None, workdir / "ros_home")  # ROS_DOMAIN_ID: this process's
    os.environ.update({k: env[k] for k in ("RMW_IMPLEMENTATION", "ROS_AUTOMATIC_DISCOVERY_RANGE",
                                           "FASTRTPS_DEFAULT_PROFILES_FILE")})
    os.environ.pop("ROS_LOCALHOST_ONLY", None)
    stats_path = workdir / "runtime_stats.json"
    py = sys.executable
    runtime_cmd = [py, "-m", "vla_edge_ros.ros.runtime", "--role", "all", "--stats-out", str(stats_path),
                   "--ros-args", "--params-file", str(ROOT / "config" / "runtime.yaml"),
                   "-p", f"eviction_policy:={args.policy}", "-p", f"backend:={args.backend}"]
    if args.checkpoint:
        runtime_cmd += ["-p", f"checkpoint:={args.checkpoint}"]
    for p in args.param:
        if ":=" not in p:
            print(f"vla_demo: --param wants NAME:=VALUE, got {p!r}", file=sys.stderr)
            return 2
        runtime_cmd += ["-p", p]
    camera_cmd = [py, "-m", "vla_edge_ros.ros.test_camera"]
    print(f"vla_demo: runtime + 60 Hz test camera, policy={args.policy}, backend={args.backend}, "
          f"{args.duration:.0f} s (logs in {workdir})")
    watcher = Watcher()
    # cwd=None: a relative --checkpoint given by the user stays relative to where the demo was started
    runtime = Child(runtime_cmd, env, workdir / "runtime.log", name="runtime", cwd=None)
    camera = Child(camera_cmd, env, workdir / "camera.log", name="camera", cwd=None)
    rc = 0
    try:
        t0 = time.monotonic()
        while True:  # start-up: engine build + warm-up
            _, diag = watcher.snapshot()
            if diag.get("vla_inference: engine", {}).get("state") == "active":
                break
            if not runtime.alive():
                raise RuntimeError(f"vla_runtime exited with {runtime.p.returncode} during start-up; see "
                                   f"{workdir / 'runtime.log'}:\n" + runtime.output()[-2000:])
            if time.monotonic() - t0 > args.startup_timeout:
                raise RuntimeError(f"vla_runtime not active after {args.startup_timeout:.0f} s; see {workdir}")
            time.sleep(0.1)
        print(f"vla_demo: inference active after {time.monotonic() - t0:.1f} s")
        t_start = time.monotonic()
        prev, _ = watcher.snapshot()
        next_print = t_start + 1.0
        while time.monotonic() - t_start < args.duration:
            time.sleep(max(0.0, next_print - time.monotonic()))
            next_print += 1.0
            kinds, diag = watcher.snapshot()
            print(live_line(time.monotonic() - t_start, kinds, prev, diag), flush=True)
            prev = kinds
            if not runtime.alive() or not camera.alive():
                raise RuntimeError(f"a child process exited early (runtime {runtime.p.returncode}, camera "
                                   f"{camera.p.returncode}); logs in {workdir}")
    except (RuntimeError, KeyboardInterrupt) as exc:
        print(f"vla_demo: {exc}", file=sys.stderr)
        rc = 1
    finally:
        for child in (runtime, camera):  # SIGINT to both first: they shut down in parallel, as before
            child.interrupt()
        for child in (runtime, camera):
            if child.stop(20) == -9:  # did not exit on SIGINT: killed
                rc = rc or 1
        kinds, _ = watcher.snapshot()
        watcher.close()
    if rc:
        return rc
    if runtime.p.returncode != 0 or not stats_path.exists():
        print(f"vla_demo: runtime exit code {runtime.p.returncode}, stats {'missing' if not stats_path.exists() else 'ok'}"
              f"; see {workdir / 'runtime.log'}", file=sys.stderr)
        return 1
    stats = json.loads(stats_path.read_text())
    res = build_result(stats, kinds, args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(summary_table(res))
    print(f"vla_demo: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
