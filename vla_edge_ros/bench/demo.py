"""`make demo`: the whole pipeline on the embedded default model for DURATION seconds.

    python -m vla_edge_ros.bench.demo --duration 20 --policy semantic --out results/demo.json
    python -m vla_edge_ros.bench.demo --sim [--checkpoint DIR] [--task drawer-close] [--episodes N]  (closed loop)

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

    def __init__(self, action_topic: str = "/vla/action", status_topic: str = "/vla/action_status"):
        import rclpy
        from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
        from rclpy.executors import SingleThreadedExecutor
        from sensor_msgs.msg import JointState

        from vla_edge_ros.ros import qos

        self.rclpy = rclpy
        rclpy.init(args=[])
        self.node = rclpy.create_node("vla_demo_watcher")
        self.lock = threading.Lock()
        self.kinds = {"fresh": 0, "repeat": 0, "hold": 0, "other": 0}
        self.reasons: dict[str, int] = {}  # "kind: reason" of every tick status received
        self.status_ticks = 0
        self.lost_ticks = 0  # gaps in the publisher's running tick number
        self._last_tick: Optional[int] = None
        self._last_fresh_s: Optional[float] = None  # monotonic time of the last fresh tick received
        self.longest_without_fresh_s = 0.0  # the longest stretch between fresh ticks (measured from the window)
        self.measuring = False
        self.diag: dict[str, dict[str, str]] = {}
        self.diag_msgs = 0
        self.node.create_subscription(JointState, action_topic, self._on_action, qos.reliable_qos(50))
        self.node.create_subscription(DiagnosticStatus, status_topic, self._on_status, qos.reliable_qos(50))
        self.node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diag, qos.reliable_qos(10))
        self.ex = SingleThreadedExecutor()
        self.ex.add_node(self.node)
        self.thread = threading.Thread(target=self.ex.spin, daemon=True)
        self.thread.start()

    def _on_action(self, msg) -> None:
        k = msg.header.frame_id if msg.header.frame_id in self.kinds else "other"
        with self.lock:
            self.kinds[k] += 1

    def _on_status(self, msg) -> None:
        v = {kv.key: kv.value for kv in msg.values}
        key = f"{v.get('kind', '?')}: {v.get('reason', '') or '-'}"
        now = time.monotonic()
        with self.lock:
            if self.measuring and v.get("kind") == "fresh":
                if self._last_fresh_s is not None:
                    self.longest_without_fresh_s = max(self.longest_without_fresh_s, now - self._last_fresh_s)
                self._last_fresh_s = now
            self.status_ticks += 1
            self.reasons[key] = self.reasons.get(key, 0) + 1
            try:
                tick = int(v.get("tick", ""))
            except ValueError:
                return
            if self._last_tick is not None and tick > self._last_tick + 1:
                self.lost_ticks += tick - self._last_tick - 1
            self._last_tick = tick

    def _on_diag(self, msg) -> None:
        with self.lock:
            self.diag_msgs += 1
            for st in msg.status:
                self.diag[st.name] = {kv.key: kv.value for kv in st.values} | {"_message": st.message}

    def snapshot(self) -> tuple[dict, dict]:
        with self.lock:
            return dict(self.kinds), {k: dict(v) for k, v in self.diag.items()}

    def tick_figures(self) -> dict:
        """Counters of the per-tick status stream (reasons, ticks received, ticks lost in transport)."""
        with self.lock:
            return {"reasons": dict(self.reasons), "status_ticks": self.status_ticks, "lost": self.lost_ticks,
                    "longest_without_fresh_s": self.longest_without_fresh_s}

    def start_measuring(self) -> None:
        with self.lock:
            self.measuring, self._last_fresh_s = True, time.monotonic()

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


def _delta(now: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in now.items() if v - before.get(k, 0)}


def _top_reasons(reasons: dict, kinds: tuple[str, ...] = ("hold", "repeat"), n: int = 2) -> str:
    """The most frequent reasons of the given kinds, e.g. 'hold: frame_stale 12, repeat: no_new_action 3'."""
    picked = sorted(((c, r) for r, c in reasons.items() if r.split(":")[0] in kinds), reverse=True)[:n]
    return ", ".join(f"{r} {c}" for c, r in picked)


def inference_line(inf: dict) -> str:
    """The inference node's own verdict (its /diagnostics message) and the admission estimate vs budget."""
    est, budget = _f(inf, "chunk_estimate_ms"), _f(inf, "chunk_budget_ms")
    fit = f"est {est:.1f}/{budget:.1f} ms" if math.isfinite(est) and math.isfinite(budget) else "est -"
    return f"{fit} | {inf.get('_message', inf.get('state', 'starting'))}"


def live_line(t: float, kinds: dict, prev: dict, diag: dict, reasons: Optional[dict] = None) -> str:
    inf = diag.get("vla_inference: engine", {})
    cam = diag.get("vla_camera: ingest", {})
    act = diag.get("vla_action: publisher", {})
    d = {k: kinds[k] - prev.get(k, 0) for k in ("fresh", "repeat", "hold")}
    n = max(1, sum(d.values()))
    why = _top_reasons(reasons or {})
    return (f"t={t:5.1f}s  ticks/s fresh {d['fresh']:2d} repeat {d['repeat']:2d} hold {d['hold']:2d} "
            f"({d['fresh'] / n:4.0%} fresh){' [' + why + ']' if why else ''} | "
            f"chunks ok {inf.get('chunks_admitted', '-')} refused {inf.get('chunks_refused', '-')} "
            f"miss {inf.get('deadline_misses', '-')} | p99 {_f(inf, 'latency_ms_p99'):.1f} ms | "
            f"frames {cam.get('frames_received', '-')} drop {cam.get('frames_dropped', '-')} "
            f"rej {cam.get('frames_rejected', '-')} | KV {inf.get('kv_occupancy_tokens', '-')}/"
            f"{inf.get('kv_budget_tokens', '-')} {inf.get('kv_policy', '-')} | "
            f"timer p99 {_f(act, 'timer_period_error_ms_p99'):.2f} ms | {inference_line(inf)}")


def summary_table(res: dict) -> str:
    chunks = res["chunks"]
    rows = [
        ("backend", res.get("backend")),
        ("measured window / runtime active (s)",
         f"{res['duration_s']:.1f} / {_num(res.get('runtime_active_s'))} (the runtime counts from activation "
         "to its SIGINT)"),
        ("ticks fresh / repeat / hold", "{fresh} / {repeat} / {hold}".format(**res["ticks"])),
        ("fresh share of ticks", f"{res['fresh_fraction']:.1%}"),
        ("hold reasons", _reasons_text(res.get("hold_reasons", {}))),
        ("chunks admitted / refused / deadline misses",
         "{admitted} / {refused} / {deadline_misses}".format(**chunks)),
        ("deadline misses after the first %g s (steady state)" % STEADY_AFTER_S,
         "n/a" if res.get("deadline_misses_steady") is None else str(res["deadline_misses_steady"])),
        ("refused: estimate over budget / no time left",
         f"{chunks.get('refused_for_cost', 'n/a')} / {chunks.get('refused_no_time', 'n/a')}"),
        ("chunk latency p50 / p95 / p99 (ms)", " / ".join(_num(res["latency_ms"][k]) for k in ("p50", "p95", "p99"))),
        ("admission estimate / budget (ms)", f"{_num(res['admission'].get('estimate_ms'))} / "
         f"{_num(res['admission'].get('budget_ms'))} (mean + spread {_num(res['admission'].get('spread_ms'))})"),
        ("timer period error p50 / p99 (ms)",
         " / ".join(_num(res["timer_period_error_ms"][k]) for k in ("p50", "p99"))),
        ("frames received / dropped / rejected", "{received} / {dropped} / {rejected}".format(**res["frames"])),
        ("KV policy / budget / max occupancy (tokens)",
         "{policy} / {budget_tokens} / {max_occupancy_tokens}".format(**res["kv"])),
        ("peak RSS / peak VRAM (MiB)", f"{_num(res['memory']['peak_rss_mb'])} / {_num(res['memory']['peak_vram_mb'])}"),
        ("longest stretch without a fresh action (s)",
         _num(res.get("longest_without_fresh_s"))
         + (f" (camera silent {res['camera_stall']['for_s']:g} s: recovery "
            f"{_num(res['longest_without_fresh_s'] - res['camera_stall']['for_s'])} s)"
            if res.get("camera_stall", {}).get("for_s") and res.get("longest_without_fresh_s") is not None else "")),
        ("subscriber, measured window (fresh/repeat/hold)",
         "{fresh} / {repeat} / {hold}".format(**res["subscriber_ticks"])
         + f", {res['subscriber_lost_ticks']} lost in transport"),
    ]
    w = max(len(r[0]) for r in rows)
    line = "-" * (w + 30)
    out = [line] + [f"{k:<{w}}  {v}" for k, v in rows] + [line]
    out += [f"WARNING: {m}" for m in res.get("warnings", [])]
    return "\n".join(out)


def _reasons_text(reasons: dict) -> str:
    return ", ".join(f"{r} {n}" for r, n in sorted(reasons.items(), key=lambda kv: -kv[1])) or "none"


def _num(x: Any) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{float(x):.2f}"


TIMER_P99_GOAL_MS = 3.0
FRESH_GOAL = 0.90


def warnings_for(res: dict, inference_messages: dict) -> list[str]:
    """What a user should read before the numbers: the model does not fit, holds dominate, the timer jitters."""
    out = []
    slow = {m: n for m, n in inference_messages.items() if m.startswith("chunk estimate")}
    if slow:
        out.append(f"the model is too slow for this machine during {sum(slow.values())} of the run's seconds: "
                   f"{max(slow, key=slow.get)}. Lower kv_budget_tokens or decode_tokens, raise deadline_ms, "
                   "or use a faster machine")
    if res["fresh_fraction"] < FRESH_GOAL:
        out.append(f"only {res['fresh_fraction']:.0%} of the ticks were fresh; hold reasons: "
                   f"{_reasons_text(res.get('hold_reasons', {}))}")
    steady = res.get("deadline_misses_steady")
    if steady:
        out.append(f"{steady} admitted chunks missed their deadline after the first {STEADY_AFTER_S:g} s (steady "
                   "state): the chunk cost has a tail the admission estimate does not cover (see cost_quantile)")
    p99 = res["timer_period_error_ms"].get("p99")
    if p99 is not None and math.isfinite(float(p99)) and float(p99) > TIMER_P99_GOAL_MS:
        out.append(f"30 Hz timer period error p99 {float(p99):.1f} ms > {TIMER_P99_GOAL_MS} ms: the action "
                   f"timer's thread waited for a core or the GIL (load average at the end "
                   f"{res['config']['load_avg_at_end']}, {res['config']['cpu_count']} cores)")
    return out


STEADY_AFTER_S = 2.0  # the first chunks compile / fill caches / fill the KV cache: not the steady state


def build_result(stats: dict, subscriber: dict, args: argparse.Namespace, window_s: float = math.nan,
                 ticks_seen: Optional[dict] = None, inference_messages: Optional[dict] = None,
                 misses_before_steady: Optional[int] = None) -> dict:
    ticks = stats.get("ticks", {"fresh": 0, "repeat": 0, "hold": 0})
    total = max(1, sum(ticks.values()))
    inf = stats.get("inference", {})
    adm = (inf.get("loop") or {}).get("admission") or inf.get("admission") or {}
    fit = (inf.get("loop") or {}).get("deadline_fit") or {}
    chunks = dict(stats.get("chunks", {}))
    chunks.update({k: adm[k] for k in ("refused_for_cost", "refused_no_time") if k in adm})
    seen = ticks_seen or {}
    res = {
        "backend": stats.get("backend"),
        "duration_s": window_s,
        "runtime_active_s": stats.get("duration_s"),
        "ticks": ticks,
        "fresh_fraction": ticks.get("fresh", 0) / total,
        "hold_reasons": ((stats.get("action") or {}).get("arbiter") or {}).get("hold_reasons", {}),
        "chunks": chunks,
        "latency_ms": stats.get("latency_ms", {}),
        "admission": {"estimate_ms": fit.get("estimate_ms"), "budget_ms": fit.get("budget_ms"),
                      "spread_ms": adm.get("spread_ms"), "cost_quantile": adm.get("cost_quantile")},
        "timer_period_error_ms": stats.get("timer_period_error_ms", {}),
        "frames": {k: stats.get("frames", {}).get(k) for k in ("received", "dropped", "rejected")},
        "kv": stats.get("kv", {}),
        "memory": stats.get("memory", {}),
        "subscriber_ticks": {k: subscriber.get(k, 0) for k in ("fresh", "repeat", "hold")},
        "subscriber_reasons": seen.get("reasons", {}),
        "subscriber_lost_ticks": seen.get("lost", 0),
        "longest_without_fresh_s": seen.get("longest_without_fresh_s"),
        "camera_stall": {"after_s": getattr(args, "camera_stall_after_s", None),
                         "for_s": getattr(args, "camera_stall_for_s", None)},
        "frame_to_action_ms": inf.get("frame_to_action_ms"),
        # misses after the first STEADY_AFTER_S of the window (the inference node's count at that second subtracted)
        "deadline_misses_steady": (None if misses_before_steady is None or chunks.get("deadline_misses") is None
                                   else int(chunks["deadline_misses"]) - int(misses_before_steady)),
        "missed_ticks": stats.get("action", {}).get("missed_ticks"),
        "config": {"policy": args.policy, "requested_backend": args.backend, "checkpoint": args.checkpoint,
                   "params": list(args.param),
                   "camera": f"vla_test_camera {getattr(args, 'camera_rate_hz', 60.0):g} Hz rgb8 640x480", "cpu_count": os.cpu_count(),
                   "load_avg_at_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None},
    }
    res["warnings"] = warnings_for(res, inference_messages or {})
    return res


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--sim" in argv:  # the closed loop: sim + runtime, success figures, an episode GIF (bench/demo_sim.py)
        from vla_edge_ros.bench import demo_sim

        return demo_sim.main([a for a in argv if a != "--sim"])
    ap = argparse.ArgumentParser(prog="vla_demo", description="run the runtime on the tiny default and report "
                                 "(--sim: the closed loop with the simulated arm, see bench/demo_sim.py)")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of control after inference is active")
    ap.add_argument("--policy", default="semantic", help="eviction_policy (semantic | fifo | sliding_window)")
    ap.add_argument("--backend", default="auto", help="auto | cuda | numpy")
    ap.add_argument("--checkpoint", default="", help="checkpoint directory (empty: embedded tiny default)")
    ap.add_argument("--param", action="append", default=[], metavar="NAME:=VALUE",
                    help="extra runtime parameter (repeatable), e.g. --param kv_budget_tokens:=1024")
    ap.add_argument("--out", default="results/demo.json")
    ap.add_argument("--startup-timeout", type=float, default=120.0, help="max seconds to reach 'active'")
    ap.add_argument("--camera-rate-hz", type=float, default=60.0, help="rate of the test camera (640x480 rgb8)")
    ap.add_argument("--camera-stall-after-s", type=float, default=None,
                    help="the test camera goes silent this many seconds after it starts (recovery test)")
    ap.add_argument("--camera-stall-for-s", type=float, default=None, help="... for this many seconds")
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
    camera_cmd = [py, "-m", "vla_edge_ros.ros.tools.test_camera"]
    if args.camera_stall_after_s is not None:
        camera_cmd += ["--stall-after-s", str(args.camera_stall_after_s),
                       "--stall-for-s", str(args.camera_stall_for_s or 3.0)]
    camera_cmd += ["--ros-args", "-p", f"rate_hz:={args.camera_rate_hz}"]
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
        kinds0, ticks0 = prev, watcher.tick_figures()
        watcher.start_measuring()
        prev_reasons = ticks0["reasons"]
        inference_messages: dict[str, int] = {}  # the inference node's /diagnostics verdicts, seconds each
        misses_before_steady: Optional[int] = None
        next_print = t_start + 1.0
        while time.monotonic() - t_start < args.duration:
            time.sleep(max(0.0, next_print - time.monotonic()))
            next_print += 1.0
            kinds, diag = watcher.snapshot()
            reasons = watcher.tick_figures()["reasons"]
            print(live_line(time.monotonic() - t_start, kinds, prev, diag, _delta(reasons, prev_reasons)), flush=True)
            if misses_before_steady is None and time.monotonic() - t_start >= STEADY_AFTER_S:
                m = diag.get("vla_inference: engine", {}).get("deadline_misses")
                misses_before_steady = None if m in (None, "-") else int(m)
            msg = diag.get("vla_inference: engine", {}).get("_message", "")
            inference_messages[msg] = inference_messages.get(msg, 0) + 1
            prev, prev_reasons = kinds, reasons
            if not runtime.alive() or not camera.alive():
                raise RuntimeError(f"a child process exited early (runtime {runtime.p.returncode}, camera "
                                   f"{camera.p.returncode}); logs in {workdir}")
        window_s = time.monotonic() - t_start
        kinds_end, ticks_end = watcher.snapshot()[0], watcher.tick_figures()
        window_kinds = {k: kinds_end[k] - kinds0.get(k, 0) for k in kinds_end}
        window_ticks = {"reasons": _delta(ticks_end["reasons"], ticks0["reasons"]),
                        "lost": ticks_end["lost"] - ticks0["lost"],
                        "longest_without_fresh_s": ticks_end["longest_without_fresh_s"]}
    except (RuntimeError, KeyboardInterrupt) as exc:
        print(f"vla_demo: {exc}", file=sys.stderr)
        rc = 1
    finally:
        for child in (runtime, camera):  # SIGINT to both first: they shut down in parallel, as before
            child.interrupt()
        for child in (runtime, camera):
            if child.stop(20) == -9:  # did not exit on SIGINT: killed
                rc = rc or 1
        watcher.close()
    if rc:
        return rc
    if runtime.p.returncode != 0 or not stats_path.exists():
        print(f"vla_demo: runtime exit code {runtime.p.returncode}, stats {'missing' if not stats_path.exists() else 'ok'}"
              f"; see {workdir / 'runtime.log'}", file=sys.stderr)
        return 1
    stats = json.loads(stats_path.read_text())
    res = build_result(stats, window_kinds, args, window_s, window_ticks, inference_messages, misses_before_steady)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(summary_table(res))
    print(f"vla_demo: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
