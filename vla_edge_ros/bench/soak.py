"""`make soak DURATION=<s>`: the runtime against a 60 Hz camera for a long time; does anything drift or leak?

    python -m vla_edge_ros.bench.soak --duration 1800 --out results/soak.json

Starts `vla_runtime` (role all; registry defaults unless ``--param name:=value`` / ``--params-file``) and
`vla_test_camera` (60 Hz rgb8 640x480) as child processes and listens to ``/vla/action`` in this process, as a
robot driver would. After a warm-up (first fresh action + ``--warmup-s``) it measures for ``--duration``
seconds:

- rss_growth_pct        RSS of the runtime process (/proc/<pid>/status VmRSS, sampled every second): median of
                        the last 5 s of the window vs median of its first 5 s;
- vram_growth_pct       the same for device memory from the runtime's own figures (cuda backend); null on the
                        numpy backend (no device memory: ``vram_note`` says so);
- kv_max_occupancy_tokens / kv_budget_tokens   the largest KV occupancy any chunk reported (must never exceed);
- ticks_expected / ticks_published   ticks counted by this subscriber between the first and the last tick it
                        received in the window, against the number of timer periods between them (reliable QoS,
                        so a tick missing here was never published);
- longest_tick_gap_ms   the longest gap between consecutive ticks as received here, i.e. as a consumer sees it
                        (``publisher_longest_gap_ms_lifetime``: the action node's own timer figure, whole run);
- deadline_misses       chunks that overran their deadline during the window (runtime's figures).

Prints a table, writes the JSON, exits 1 when a limit is violated (RSS growth >= --max-rss-growth-pct, any missed
tick beyond --max-missed-ticks, a gap >= --max-gap-periods periods, KV occupancy over budget, more than
--max-miss-pct percent of the admitted chunks late, no chunk admitted), 2 when the system
could not be run at all, 0 otherwise. Why child processes: the camera crosses a real DDS transport, and what is
measured is the executable an operator runs, including its SIGINT shutdown.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

from vla_edge_ros.bench.procs import ACTIVE_LINE, Child, ros_child_env, rss_mb

STOP_TIMEOUT_S = 20.0  # SIGINT to exit: the runtime writes its final stats while shutting down


class TickListener:
    """Subscribes the action topic (reliable, deep queue) and keeps running figures of the ticks it receives.

    ``start_window()`` begins the measured window: counts, kinds and the longest gap are taken from the first
    tick received after it; ``stop_window()`` freezes them."""

    def __init__(self, action_topic: str):
        import rclpy
        from rclpy.executors import SingleThreadedExecutor
        from sensor_msgs.msg import JointState

        from vla_edge_ros.ros import qos

        self.rclpy = rclpy
        from rclpy.signals import SignalHandlerOptions

        self.ctx = rclpy.context.Context()
        # this script handles SIGINT itself (stop measuring, stop the children in order, write the JSON)
        rclpy.init(context=self.ctx, args=[], signal_handler_options=SignalHandlerOptions.NO)
        self.node = rclpy.create_node("vla_soak_listener", context=self.ctx)
        self.lock = threading.Lock()
        self.total = 0
        self.kinds_total = {"fresh": 0, "repeat": 0, "hold": 0}
        self.windowing = False
        self.frozen = False
        self.first_t: Optional[float] = None
        self.last_t: Optional[float] = None
        self.count = 0
        self.kinds = {"fresh": 0, "repeat": 0, "hold": 0, "other": 0}
        self.longest_gap_s = 0.0
        self.longest_gap_at_s = 0.0  # offset into the window
        self.gaps_over: dict[str, int] = {"1.5": 0, "2": 0}  # gaps over 1.5 / 2 periods
        self.period_s = 1 / 30.0
        self.topic = action_topic
        self.node.create_subscription(JointState, action_topic, self._on_action, qos.reliable_qos(1000))
        self.ex = SingleThreadedExecutor(context=self.ctx)
        self.ex.add_node(self.node)
        self.th = threading.Thread(target=self.ex.spin, name="soak_listener", daemon=True)
        self.th.start()

    def _on_action(self, msg) -> None:
        t = time.monotonic()
        kind = msg.header.frame_id
        with self.lock:
            self.total += 1
            if kind in self.kinds_total:
                self.kinds_total[kind] += 1
            if not self.windowing or self.frozen:
                return
            if self.last_t is not None:
                gap = t - self.last_t
                if gap > self.longest_gap_s:
                    self.longest_gap_s, self.longest_gap_at_s = gap, t - self.first_t
                if gap > 1.5 * self.period_s:
                    self.gaps_over["1.5"] += 1
                if gap >= 2.0 * self.period_s:
                    self.gaps_over["2"] += 1
            else:
                self.first_t = t
            self.last_t = t
            self.count += 1
            self.kinds[kind if kind in self.kinds else "other"] += 1

    def publishers(self) -> int:
        """Publishers of the action topic: more than one means another runtime shares this ROS domain, and its
        ticks would be counted as ours."""
        return self.node.count_publishers(self.topic)

    def start_window(self, period_s: float) -> None:
        with self.lock:
            self.period_s = period_s
            self.windowing = True

    def stop_window(self) -> None:
        with self.lock:
            self.frozen = True

    def window(self) -> dict[str, Any]:
        with self.lock:
            span = (self.last_t - self.first_t) if self.count >= 2 else 0.0
            expected = int(round(span / self.period_s)) + 1 if self.count else 0
            return {"ticks_published": self.count, "ticks_expected": expected, "span_s": span,
                    "longest_gap_ms": self.longest_gap_s * 1e3, "longest_gap_at_s": self.longest_gap_at_s,
                    "gaps_over_1_5_periods": self.gaps_over["1.5"], "gaps_over_2_periods": self.gaps_over["2"],
                    "kinds": dict(self.kinds)}

    def close(self) -> None:
        self.ex.shutdown(timeout_sec=2.0)
        self.th.join(timeout=3.0)
        self.node.destroy_node()
        self.rclpy.try_shutdown(context=self.ctx)


def read_stats(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _get(d: Optional[dict], *path, default=None):
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return default
        d = d[k]
    return d


def growth_pct(start: Optional[float], end: Optional[float]) -> Optional[float]:
    if start is None or end is None or start <= 0:
        return None
    return (end - start) / start * 100.0


def _median_between(samples: list[tuple[float, float]], t0: float, t1: float) -> Optional[float]:
    vals = [v for t, v in samples if t0 <= t <= t1]
    return statistics.median(vals) if vals else None


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="vla_soak", description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, required=True, help="measured window in seconds (after warm-up)")
    ap.add_argument("--out", default="results/soak.json")
    ap.add_argument("--warmup-s", type=float, default=None,
                    help="seconds after the first fresh action before measuring (default: 10 %% of the "
                         "duration, 10 s to 60 s)")
    ap.add_argument("--param", action="append", default=[], metavar="NAME:=VALUE",
                    help="runtime parameter override, passed as -p NAME:=VALUE (repeatable)")
    ap.add_argument("--params-file", default=None, help="runtime --params-file")
    ap.add_argument("--camera-rate-hz", type=float, default=60.0)
    ap.add_argument("--camera-width", type=int, default=640)
    ap.add_argument("--camera-height", type=int, default=480)
    ap.add_argument("--max-rss-growth-pct", type=float, default=5.0)
    ap.add_argument("--max-missed-ticks", type=int, default=0)
    ap.add_argument("--max-gap-periods", type=float, default=2.0, help="a gap >= this many periods is a violation")
    ap.add_argument("--max-miss-pct", type=float, default=0.1,
                    help="admitted chunks that miss their deadline, percent of the window's admitted chunks: "
                         "admission promises to refuse what it cannot finish")
    ap.add_argument("--startup-timeout-s", type=float, default=180.0)
    ap.add_argument("--progress-every-s", type=float, default=10.0)
    ap.add_argument("--keep-logs", default=None, help="directory for the child logs (default: a temp dir)")
    return ap.parse_args(argv)


def _table(res: dict) -> str:
    rows = [
        ("backend", res["backend"]),
        ("window (s)", f"{res['duration_s']:.0f} after {res['warmup_s']:.0f} s warm-up"),
        ("RSS start -> end (MiB)", f"{res['rss_mb_start']:.1f} -> {res['rss_mb_end']:.1f}"
         if res["rss_mb_start"] is not None and res["rss_mb_end"] is not None else "n/a"),
        ("rss_growth_pct", _fmt(res["rss_growth_pct"])),
        ("vram_growth_pct", _fmt(res["vram_growth_pct"]) + ("" if res["vram_growth_pct"] is not None
                                                            else f"  ({res['vram_note']})")),
        ("kv max / budget (tokens)", f"{res['kv_max_occupancy_tokens']} / {res['kv_budget_tokens']}"),
        ("ticks published / expected", f"{res['ticks_published']} / {res['ticks_expected']} "
                                       f"(missed {res['ticks_missed']})"),
        ("ticks fresh / repeat / hold", " / ".join(str(res["ticks_by_kind"].get(k, 0))
                                                   for k in ("fresh", "repeat", "hold"))
         + f"  (fresh {100 * res['fresh_fraction']:.0f} %)"),
        ("longest_tick_gap_ms", f"{_fmt(res['longest_tick_gap_ms'])} ({_fmt(res['longest_tick_gap_periods'])} "
                                f"periods; publisher's own timer, whole run: "
                                f"{_fmt(res['publisher_longest_gap_ms_lifetime'])})"),
        ("deadline_misses", f"{res['deadline_misses']} of {res['chunks_admitted']} admitted chunks "
                            f"({_fmt(res['deadline_miss_pct'])} %)"),
        ("chunk latency p50 / p99 (ms)", f"{_fmt(res['latency_ms_p50'])} / {_fmt(res['latency_ms_p99'])}"),
        ("frames received / dropped / rejected", f"{res['frames_received']} / {res['frames_dropped']} / "
                                                 f"{res['frames_rejected']}"),
        ("gc collections / longest pause ms (gen 0, 1, 2)", _gc_text(res.get("gc"))),
        ("verdict", "OK" if not res["violations"] else "VIOLATED: " + "; ".join(res["violations"])),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{w}}  {v}" for k, v in rows)


def _gc_text(gc: Any) -> str:
    if not isinstance(gc, dict) or "collections" not in gc:
        return "n/a"
    frozen = (gc.get("freeze") or {}).get("frozen_objects")
    return (" / ".join(str(c) for c in gc["collections"]) + "; "
            + " / ".join(f"{m:.1f}" for m in gc.get("pause_ms_max", []))
            + (f"  ({frozen} objects frozen after start-up)" if frozen is not None else "  (not frozen)"))


def _fmt(x: Any) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.2f}"
    return str(x)


def run(opts: argparse.Namespace) -> int:
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    log_dir = Path(opts.keep_logs) if opts.keep_logs else Path(tempfile.mkdtemp(prefix="vla_soak_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    env = ros_child_env(None, log_dir / "ros_home")  # ROS_DOMAIN_ID: this process's
    for k in ("RMW_IMPLEMENTATION", "ROS_AUTOMATIC_DISCOVERY_RANGE", "FASTRTPS_DEFAULT_PROFILES_FILE", "ROS_HOME",
              "ROS_LOG_DIR"):
        os.environ[k] = env[k]  # this process's listener uses the same middleware settings
    os.environ.pop("ROS_LOCALHOST_ONLY", None)
    stats_path = log_dir / "runtime_stats.json"
    ros_args = ["--ros-args"]
    if opts.params_file:
        ros_args += ["--params-file", opts.params_file]
    for p in opts.param:
        if ":=" not in p:
            print(f"vla_soak: --param expects NAME:=VALUE, got {p!r}", file=sys.stderr)
            return 2
        ros_args += ["-p", p]
    runtime = Child([sys.executable, "-m", "vla_edge_ros.ros.runtime", "--stats-out", str(stats_path),
                     "--stats-every-s", "2", *(ros_args if len(ros_args) > 1 else [])], env, log_dir / "runtime.log",
                    name="runtime")
    listener = TickListener("/vla/action")
    camera: Optional[Child] = None
    rss: list[tuple[float, float]] = []
    stats_at_start: Optional[dict] = None
    t0 = t1 = None
    max_publishers = 0
    warmup_s = opts.warmup_s if opts.warmup_s is not None else min(60.0, max(10.0, 0.1 * opts.duration))
    failure = ""
    print(f"[soak] logs in {log_dir}; runtime pid {runtime.p.pid}", flush=True)
    try:
        deadline = time.monotonic() + opts.startup_timeout_s
        while ACTIVE_LINE not in runtime.output():
            if not runtime.alive() or time.monotonic() > deadline or stop.is_set():
                failure = "runtime did not reach 'active'"
                break
            time.sleep(0.2)
        if not failure:
            camera = Child([sys.executable, "-m", "vla_edge_ros.ros.tools.test_camera", "--ros-args",
                            "-p", f"rate_hz:={opts.camera_rate_hz}", "-p", f"width:={opts.camera_width}",
                            "-p", f"height:={opts.camera_height}"], env, log_dir / "camera.log", name="camera")
            while listener.kinds_total["fresh"] == 0:
                if not runtime.alive() or time.monotonic() > deadline or stop.is_set():
                    failure = "no fresh action from the runtime"
                    break
                time.sleep(0.2)
        if not failure:
            print(f"[soak] first fresh action; warm-up {warmup_s:.0f} s, then measuring {opts.duration:.0f} s",
                  flush=True)
            stop.wait(warmup_s)
            rate_hz = float(_get(read_stats(stats_path), "action", "action_rate_hz", default=30.0) or 30.0)
            period_s = 1.0 / rate_hz
            stats_at_start = read_stats(stats_path)
            listener.start_window(period_s)
            t0 = time.monotonic()
            t_end = t0 + opts.duration
            next_progress = t0 + opts.progress_every_s
            while not stop.is_set() and time.monotonic() < t_end:
                now = time.monotonic()
                v = rss_mb(runtime.p.pid)
                if v is None or not runtime.alive() or not camera.alive():
                    failure = "runtime or camera process died during the soak"
                    break
                rss.append((now, v))
                max_publishers = max(max_publishers, listener.publishers())
                if now >= next_progress:
                    w = listener.window()
                    print(f"[soak] {now - t0:7.0f} s  ticks {w['ticks_published']}/{w['ticks_expected']}  "
                          f"fresh {w['kinds']['fresh']}  longest gap {w['longest_gap_ms']:.1f} ms  "
                          f"RSS {v:.1f} MiB", flush=True)
                    next_progress += opts.progress_every_s
                stop.wait(max(0.0, min(1.0, t_end - time.monotonic())))
            listener.stop_window()
            t1 = time.monotonic()
            v = rss_mb(runtime.p.pid)
            if v is not None:
                rss.append((t1, v))
    finally:
        final_live = read_stats(stats_path)
        cam_rc = camera.stop(STOP_TIMEOUT_S) if camera is not None else None
        rt_rc = runtime.stop(STOP_TIMEOUT_S)
        listener.close()
    final = read_stats(stats_path) or final_live  # written by the runtime at SIGINT shutdown
    if failure or t0 is None:
        print(f"[soak] FAILED: {failure or 'interrupted before measuring'}\n--- runtime log tail ---\n"
              f"{runtime.output()[-3000:]}", file=sys.stderr)
        return 2

    w = listener.window()
    dur = t1 - t0
    edge = min(5.0, dur / 4)
    rss_start = _median_between(rss, t0, t0 + edge)
    rss_end = _median_between(rss, t1 - edge, t1)
    backend = _get(final, "backend", default="?")
    vram_start = _get(stats_at_start, "inference", "vram_mb")
    vram_end = _get(final_live, "inference", "vram_mb")
    if backend == "cuda":
        vram_growth, vram_note = growth_pct(vram_start, vram_end), "device memory of the cuda backend"
    else:
        vram_growth, vram_note = None, f"{backend} backend: no device memory (CPU only)"
    misses_start = _get(stats_at_start, "chunks", "deadline_misses", default=0) or 0
    admitted_start = _get(stats_at_start, "chunks", "admitted", default=0) or 0
    kv_max = _get(final, "kv", "max_occupancy_tokens")
    kv_budget = _get(final, "kv", "budget_tokens")
    missed = max(0, w["ticks_expected"] - w["ticks_published"])
    gap_periods = w["longest_gap_ms"] / (1e3 / rate_hz)
    res: dict[str, Any] = {
        "duration_s": dur,
        "warmup_s": warmup_s,
        "backend": backend,
        "action_rate_hz": rate_hz,
        "camera_rate_hz": opts.camera_rate_hz,
        "rss_growth_pct": growth_pct(rss_start, rss_end),
        "rss_mb_start": rss_start,
        "rss_mb_end": rss_end,
        "rss_mb_max": max((v for _, v in rss), default=None),
        "rss_samples": len(rss),
        "vram_growth_pct": vram_growth,
        "vram_note": vram_note,
        "kv_max_occupancy_tokens": kv_max,
        "kv_budget_tokens": kv_budget,
        "kv_policy": _get(final, "kv", "policy"),
        "ticks_expected": w["ticks_expected"],
        "ticks_published": w["ticks_published"],
        "ticks_missed": missed,
        "ticks_by_kind": w["kinds"],
        "fresh_fraction": w["kinds"]["fresh"] / w["ticks_published"] if w["ticks_published"] else 0.0,
        "longest_tick_gap_ms": w["longest_gap_ms"],
        "longest_tick_gap_periods": gap_periods,
        "longest_tick_gap_at_s": w["longest_gap_at_s"],
        "gaps_over_1_5_periods": w["gaps_over_1_5_periods"],
        # the action node's own timer figure; it covers the whole run (start-up included), not just the window
        "publisher_longest_gap_ms_lifetime": _get(final_live, "action", "longest_gap_ms"),
        "publisher_missed_ticks_lifetime": _get(final_live, "action", "missed_ticks"),
        "deadline_misses": (_get(final, "chunks", "deadline_misses", default=0) or 0) - misses_start,
        "chunks_admitted": (_get(final, "chunks", "admitted", default=0) or 0) - admitted_start,
        "chunks_refused_lifetime": _get(final, "chunks", "refused"),
        "latency_ms_p50": _get(final, "latency_ms", "p50"),
        "latency_ms_p99": _get(final, "latency_ms", "p99"),
        "frames_received": _get(final, "frames", "received"),
        "frames_dropped": _get(final, "frames", "dropped"),
        "frames_rejected": _get(final, "frames", "rejected"),
        # the cyclic collector's pauses in the runtime (core/gc_pauses.py), whole run: a long tick gap with a
        # generation-2 pause as long is the collector's
        "gc": _get(final, "gc"),
        "runtime_exit_code": rt_rc,
        "camera_exit_code": cam_rc,
        "interrupted": stop.is_set(),
        "action_publishers_max": max_publishers,
        "limits": {"max_rss_growth_pct": opts.max_rss_growth_pct, "max_missed_ticks": opts.max_missed_ticks,
                   "max_gap_periods": opts.max_gap_periods, "max_miss_pct": opts.max_miss_pct},
    }
    res["deadline_miss_pct"] = (100.0 * res["deadline_misses"] / res["chunks_admitted"]
                                if res["chunks_admitted"] else None)
    v: list[str] = []
    if res["rss_growth_pct"] is None:
        v.append("RSS could not be sampled")
    elif res["rss_growth_pct"] >= opts.max_rss_growth_pct:
        v.append(f"RSS grew {res['rss_growth_pct']:.2f} % (limit {opts.max_rss_growth_pct} %)")
    if missed > opts.max_missed_ticks:
        v.append(f"{missed} ticks missed (limit {opts.max_missed_ticks})")
    if w["ticks_published"] == 0:
        v.append("no ticks received")
    if gap_periods >= opts.max_gap_periods:
        v.append(f"longest tick gap {w['longest_gap_ms']:.1f} ms = {gap_periods:.2f} periods "
                 f"(limit {opts.max_gap_periods})")
    if res["chunks_admitted"] <= 0:
        v.append("no chunk admitted in the window")
    elif res["deadline_miss_pct"] > opts.max_miss_pct:
        v.append(f"{res['deadline_misses']} of {res['chunks_admitted']} admitted chunks missed their deadline "
                 f"({res['deadline_miss_pct']:.2f} %, limit {opts.max_miss_pct} %)")
    if kv_max is None or kv_budget is None:
        v.append("KV figures missing from the runtime's stats")
    elif kv_max > kv_budget:
        v.append(f"KV occupancy {kv_max} over budget {kv_budget}")
    if max_publishers > 1:
        v.append(f"{max_publishers} publishers on /vla/action: another runtime shares ROS_DOMAIN_ID="
                 f"{os.environ.get('ROS_DOMAIN_ID', '0')}, the tick figures are void")
    if rt_rc != 0:
        v.append(f"runtime exit code {rt_rc} on SIGINT")
    res["violations"] = v
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print("\nvla_edge_ros soak\n" + _table(res) + f"\n  written to {out}", flush=True)
    return 1 if v else 0


def main(argv: Optional[list[str]] = None) -> int:
    opts = parse_args(argv)
    if not (opts.duration > 0):
        print("vla_soak: --duration must be positive", file=sys.stderr)
        return 2
    return run(opts)


if __name__ == "__main__":
    sys.exit(main())
