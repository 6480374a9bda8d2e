"""Eviction-policy sweep: the runtime over the same replayed clip, once per policy and setting.

    python -m vla_edge_ros.bench.sweep --duration 20 [--bag PATH] --out results/sweep     (make sweep)

For each setting (``nominal``: the registry defaults; ``long_context``: a KV budget of 255 frames;
``tight_deadline``: a 20 ms cycle -- the last two are stressed settings in which the admission controller
refuses chunks) and each eviction policy (semantic, fifo, sliding_window) it starts ``vla_runtime`` (its own process, ``--params-file`` written here, ``--stats-out`` JSON
rewritten every 0.5 s) and ``vla_bag_replay`` (camera re-timed to 60 Hz, JPEG decoded to rgb8, looped), samples
the runtime's RSS and KV occupancy over time, listens to the runtime's ``/vla/action`` and the bag's
``/vla/recorded_action`` (action error against the recording: meaningless for random weights, but the
plumbing is real), stops the runtime with SIGINT and reads its final figures.

Outputs in ``--out``: ``<policy>.json`` (one entry per setting), ``latency_cdf.png``, ``rates.png``,
``memory.png``, ``saliency.png`` and ``report.md``.

Bag: ``--bag``, else the real Bridge sample (``../shared/data/oxe``) converted with oxe_to_bag, else a
synthetic clip written with the project's own RLDS writer.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Optional

import numpy as np

from vla_edge_ros import params as registry
from vla_edge_ros.bench.procs import Child, ros_child_env, rss_mb, wait_active
from vla_edge_ros.bench.sweep_report import (  # noqa: F401  (re-exported)
    _fmt,
    SETTINGS, VRAM_CEILING_MB, latency_curve, make_plots, report_table, retention_at, write_report)

REPO = Path(__file__).resolve().parents[2]
SHARED_OXE = REPO.parent / "shared" / "data" / "oxe"
POLICIES = registry.EVICTION_POLICIES
DEFAULT_DOMAIN_ID = 57


# ---------------------------------------------------------------------------------------------------------------
# the clip
# ---------------------------------------------------------------------------------------------------------------

def default_bag(work: Path) -> tuple[Path, str]:
    """Convert the real Bridge sample when present, else a synthetic clip; returns (bag, description)."""
    from vla_edge_ros.data import oxe_to_bag, rlds

    bag = work / "clip_bag"
    if (SHARED_OXE / "bridge_dataset").is_dir():
        s = oxe_to_bag.convert(SHARED_OXE, bag, progress=False, overwrite=True)
        return bag, f"real Bridge sample ({s.episodes} episodes, {s.frames} frames at 5 Hz, converted by oxe_to_bag)"
    src = rlds.write_synthetic_dataset(work / "synthetic_rlds", "bridge_dataset", episodes=6, steps=20,
                                       image_hw=(96, 128))
    s = oxe_to_bag.convert(src, bag, progress=False, overwrite=True)
    return bag, f"synthetic clip ({s.episodes} episodes, {s.frames} frames at 5 Hz; ../shared/data/oxe absent)"


def first_instruction(bag: Path) -> Optional[str]:
    from rosbags.highlevel import AnyReader
    from rosbags.typesys import Stores, get_typestore

    with AnyReader([bag], default_typestore=get_typestore(Stores.ROS2_JAZZY)) as reader:
        conns = [c for c in reader.connections if c.topic == "/vla/instruction"]
        for conn, _, raw in reader.messages(connections=conns):
            return reader.deserialize(raw, conn.msgtype).data
    return None


# ---------------------------------------------------------------------------------------------------------------
# action listener (runtime actions vs recorded actions)
# ---------------------------------------------------------------------------------------------------------------

class ActionListener:
    """Own rclpy context: records fresh runtime actions (/vla/action, frame_id 'fresh') and recorded ones."""

    def __init__(self, domain_id: int):
        import rclpy
        from rclpy.context import Context
        from rclpy.executors import SingleThreadedExecutor
        from rclpy.node import Node
        from sensor_msgs.msg import JointState

        from vla_edge_ros.ros import qos

        self.rclpy = rclpy
        self.ctx = Context()
        rclpy.init(context=self.ctx, domain_id=domain_id)
        self.node = Node("vla_sweep_listener", context=self.ctx)
        self.fresh: list[tuple[int, np.ndarray]] = []
        self.recorded: list[tuple[int, np.ndarray]] = []
        self.ticks = 0
        self._lock = threading.Lock()
        self.node.create_subscription(JointState, registry.BY_NAME["action_topic"].default, self._on_action,
                                      qos.reliable_qos(100))
        self.node.create_subscription(JointState, "/vla/recorded_action", self._on_recorded, qos.reliable_qos(100))
        self.ex = SingleThreadedExecutor(context=self.ctx)
        self.ex.add_node(self.node)
        self.thread = threading.Thread(target=self.ex.spin, name="sweep_listener", daemon=True)
        self.thread.start()

    @staticmethod
    def _stamp(msg) -> int:
        return msg.header.stamp.sec * 1_000_000_000 + msg.header.stamp.nanosec

    def _on_action(self, msg) -> None:
        with self._lock:
            self.ticks += 1
            if msg.header.frame_id == "fresh":
                self.fresh.append((self._stamp(msg), np.asarray(msg.position, np.float64)))

    def _on_recorded(self, msg) -> None:
        with self._lock:
            self.recorded.append((self._stamp(msg), np.asarray(msg.position, np.float64)))

    def reset(self) -> None:
        with self._lock:
            self.fresh.clear()
            self.recorded.clear()
            self.ticks = 0

    def action_error(self) -> dict[str, Any]:
        """Mean |runtime - recorded| per fresh action, against the recorded action current at its source frame."""
        with self._lock:
            fresh, rec = list(self.fresh), sorted(self.recorded, key=lambda x: x[0])
        out: dict[str, Any] = {"fresh_actions_heard": len(fresh), "recorded_actions_heard": len(rec),
                               "matched": 0, "mae": None, "mae_per_dim": None}
        if not fresh or not rec:
            return out
        stamps = np.array([s for s, _ in rec])
        errs = []
        for s, a in fresh:
            i = int(np.searchsorted(stamps, s, side="right")) - 1
            if i < 0 or rec[i][1].shape != a.shape:
                continue
            errs.append(np.abs(a - rec[i][1]))
        if errs:
            e = np.stack(errs)
            out.update(matched=len(errs), mae=float(e.mean()), mae_per_dim=[float(x) for x in e.mean(axis=0)])
        return out

    def close(self) -> None:
        self.ex.shutdown(timeout_sec=2.0)
        self.thread.join(timeout=2.0)
        self.node.destroy_node()
        self.rclpy.shutdown(context=self.ctx)


# ---------------------------------------------------------------------------------------------------------------
# one run
# ---------------------------------------------------------------------------------------------------------------

def write_params(path: Path, policy: str, overrides: dict[str, Any], backend: str, checkpoint: str,
                 instruction: Optional[str]) -> dict[str, Any]:
    import yaml

    inference = {"eviction_policy": policy, "backend": backend, **overrides}
    if checkpoint:
        inference["checkpoint"] = checkpoint
    if instruction:
        inference["instruction"] = instruction
    reasons = registry.validate_all(inference)
    if reasons:
        raise ValueError(f"sweep parameters rejected by the registry: {'; '.join(reasons)}")
    # the replay repeats each 5 Hz bag frame ~12 times at 60 Hz on purpose: the frozen-camera check stays off
    doc = {"vla_inference": {"ros__parameters": inference},
           "vla_camera": {"ros__parameters": {"frozen_frame_limit": 0}}}
    path.write_text(yaml.safe_dump(doc, sort_keys=True))
    return inference


def _read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _get(d: Any, *path: str, default=None):
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return default
        d = d[k]
    return d


def _find_key(d: Any, key: str):
    """First value stored under ``key`` anywhere in a nested dict (runtime stats may move things around)."""
    if isinstance(d, dict):
        if key in d:
            return d[key]
        for v in d.values():
            found = _find_key(v, key)
            if found is not None:
                return found
    return None


def run_once(bag: Path, policy: str, setting: str, duration: float, out_dir: Path, env: dict[str, str],
             backend: str, checkpoint: str, instruction: Optional[str], listener: Optional[ActionListener],
             camera_hz: float, startup_timeout: float, extra: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    tag = f"{setting}_{policy}"
    logs = out_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    params_path = logs / f"{tag}.params.yaml"
    inference_params = write_params(params_path, policy, {**SETTINGS[setting], **(extra or {})}, backend, checkpoint,
                                    instruction)
    stats_path = logs / f"{tag}.stats.json"
    replay_stats = logs / f"{tag}.replay.json"
    for p in (stats_path, replay_stats):
        p.unlink(missing_ok=True)
    runtime = Child(
        [sys.executable, "-m", "vla_edge_ros.ros.runtime", "--stats-out", str(stats_path), "--stats-every-s", "0.5",
         "--duration-s", str(duration + startup_timeout + 60), "--ros-args", "--params-file", str(params_path)],
        env, logs / f"{tag}.runtime.log", name="runtime", cwd=REPO)
    # the replay starts once inference is active: --duration is time spent serving (a quantised-at-load 1.5B
    # checkpoint loads for up to ~50 s; a replay started at the camera subscription held through all of it)
    not_active = wait_active(runtime, startup_timeout)
    if not_active:
        runtime.stop(30)
        result = summarise(policy, setting, inference_params, _read_json(stats_path) or {}, {}, [], None,
                           runtime.p.returncode)
        result["error"] = not_active
        return result
    if listener is not None:
        listener.reset()
    replay = Child(
        [sys.executable, "-m", "vla_edge_ros.ros.tools.bag_replay", str(bag), "--camera-hz", str(camera_hz), "--decode",
         "--loop", "--duration-s", str(duration), "--wait-for", "/camera/image_raw", "--wait-timeout-s",
         str(startup_timeout), "--stats-out", str(replay_stats)],
        env, logs / f"{tag}.replay.log", name="replay", cwd=REPO)
    timeline: list[dict[str, Any]] = []
    t0 = time.monotonic()
    last_mtime = 0.0
    try:
        while replay.alive() and runtime.alive():
            time.sleep(0.25)
            sample: dict[str, Any] = {"t_s": round(time.monotonic() - t0, 3),
                                      "rss_mb": rss_mb(runtime.p.pid, tree=True)}
            try:
                mtime = stats_path.stat().st_mtime
            except OSError:
                mtime = 0.0
            if mtime != last_mtime:
                last_mtime = mtime
                st = _read_json(stats_path) or {}
                sample["kv_occupancy_tokens"] = _get(st, "inference", "kv", "occupancy_tokens")
                sample["vram_mb"] = _get(st, "inference", "vram_mb")
                sample["admitted"] = _get(st, "chunks", "admitted")
                sample["refused"] = _get(st, "chunks", "refused")
            timeline.append(sample)
        if not runtime.alive() and replay.alive():  # the runtime died: no point replaying on
            replay.interrupt()
        replay.p.wait(timeout=startup_timeout + duration + 30)
    finally:
        runtime.stop(30)
        replay.stop(10)
    stats = _read_json(stats_path)
    rstats = _read_json(replay_stats) or {}
    result = summarise(policy, setting, inference_params, stats or {}, rstats, timeline,
                       listener.action_error() if listener is not None else None, runtime.p.returncode)
    if stats is None:  # recorded as a failed run; the other runs go on
        result["error"] = (f"the runtime wrote no stats (exit code {runtime.p.returncode}); see "
                           f"{logs / (tag + '.runtime.log')}")
    return result


# ---------------------------------------------------------------------------------------------------------------
# figures
# ---------------------------------------------------------------------------------------------------------------

def _rate(num, den) -> Optional[float]:
    try:
        return float(num) / float(den) if den else None
    except (TypeError, ValueError):
        return None


def summarise(policy: str, setting: str, inference_params: dict, stats: dict, replay: dict,
              timeline: list[dict], action_error: Optional[dict], exit_code: Optional[int]) -> dict[str, Any]:
    ticks = stats.get("ticks") or {}
    n_ticks = sum(int(ticks.get(k, 0) or 0) for k in ("fresh", "repeat", "hold"))
    chunks = stats.get("chunks") or {}
    admitted, refused = int(chunks.get("admitted", 0) or 0), int(chunks.get("refused", 0) or 0)
    misses = int(chunks.get("deadline_misses", 0) or 0)
    frames = stats.get("frames") or {}
    mem = stats.get("memory") or {}
    rss_samples = [s["rss_mb"] for s in timeline if s.get("rss_mb") is not None]
    peak_rss = max([float(mem.get("peak_rss_mb") or 0.0)] + rss_samples)
    peak_vram = float(mem.get("peak_vram_mb") or 0.0)
    kv = stats.get("kv") or {}
    saliency = _find_key(stats, "saliency")
    samples = _find_key(stats, "chunk_ms_samples") or _find_key(stats, "latency_samples_ms")
    published_frames = int(replay.get("camera_ticks", 0) or 0)
    received = int(frames.get("received", 0) or 0)
    state = _get(stats, "inference", "state")
    error = None
    if state not in (None, "active"):
        error = f"vla_inference ended in state {state!r}: {_get(stats, 'inference', 'last_error') or 'no reason'}"
    elif admitted + refused == 0:
        error = "no chunk was admitted or refused (no frames reached inference?)"
    return {
        "policy": policy,
        "setting": setting,
        "error": error,
        "params": inference_params,
        "backend": stats.get("backend"),
        "duration_s": stats.get("duration_s"),
        "runtime_exit_code": exit_code,
        "chunks": {"admitted": admitted, "refused": refused, "deadline_misses": misses},
        "deadline_miss_rate": _rate(misses, admitted),  # admitted chunks that overran the deadline
        "refusal_rate": _rate(refused, admitted + refused),
        "latency_ms": {k: _get(stats, "latency_ms", k) for k in ("p50", "p95", "p99")}
        | {"max": _get(stats, "inference", "latency_ms", "max")},
        "latency_samples_ms": samples if isinstance(samples, list) else None,
        "ticks": {k: int(ticks.get(k, 0) or 0) for k in ("fresh", "repeat", "hold")},
        "fresh_rate": _rate(ticks.get("fresh", 0), n_ticks),
        "fallback_rate": _rate(ticks.get("repeat", 0), n_ticks),  # repeat of the last action between chunks
        "hold_rate": _rate(ticks.get("hold", 0), n_ticks),
        "memory": {"peak_rss_mb": round(peak_rss, 1), "peak_vram_mb": round(peak_vram, 1),
                   "ceiling_mb": VRAM_CEILING_MB,
                   "peak_fraction_of_ceiling": round((peak_vram if peak_vram > 0 else peak_rss) / VRAM_CEILING_MB,
                                                     4)},
        "kv": {"policy": kv.get("policy"), "budget_tokens": kv.get("budget_tokens"),
               "max_occupancy_tokens": kv.get("max_occupancy_tokens")},
        "frames": {"published_by_replay": published_frames, "received": received,
                   "dropped_in_transport": max(0, published_frames - received) if published_frames else None,
                   "overwritten_before_inference": int(frames.get("dropped", 0) or 0),
                   "rejected": int(frames.get("rejected", 0) or 0)},
        "saliency": saliency,
        "action_error_vs_recorded": action_error,
        "timeline": timeline,
        "replay": {k: replay.get(k) for k in ("passes", "camera_ticks", "late_messages", "max_lag_ms")},
    }


# ---------------------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------------------

def main(argv: Optional[Iterable[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="vla_sweep", description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of replay per run")
    ap.add_argument("--bag", default=None, help="bag to replay (default: the Bridge sample, else synthetic)")
    ap.add_argument("--out", default="results/sweep")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--backend", default="auto", choices=registry.BACKENDS)
    ap.add_argument("--checkpoint", default="", help="checkpoint directory (default: the tiny built-in model)")
    ap.add_argument("--weight-dtype", default=None, choices=registry.BY_NAME["weight_dtype"].choices,
                    help="weight_dtype of every run (default: the parameter's default)")
    ap.add_argument("--camera-hz", type=float, default=60.0)
    ap.add_argument("--domain-id", type=int, default=DEFAULT_DOMAIN_ID)
    ap.add_argument("--startup-timeout", type=float, default=180.0,
                    help="wait this long for the runtime to be active (engine loaded, quantised, warmed up)")
    ap.add_argument("--no-listener", action="store_true", help="skip the action-error listener")
    args = ap.parse_args(list(argv) if argv is not None else None)
    policies = [p for p in args.policies.split(",") if p]
    settings = [s for s in args.settings.split(",") if s]
    bad = [p for p in policies if p not in POLICIES] + [s for s in settings if s not in SETTINGS]
    if bad:
        print(f"vla_sweep: unknown policy/setting: {', '.join(bad)}", file=sys.stderr)
        return 2
    if args.duration <= 0:
        print("vla_sweep: --duration must be > 0", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="vla_sweep_"))
    if args.bag:
        bag, desc = Path(args.bag), "given bag"
        if not bag.exists():
            print(f"vla_sweep: bag {bag} does not exist", file=sys.stderr)
            return 2
    else:
        bag, desc = default_bag(work)
    instruction = first_instruction(bag)
    extra = {"weight_dtype": args.weight_dtype} if args.weight_dtype else {}
    env = ros_child_env(args.domain_id, work / "ros_home")
    for k in ("ROS_AUTOMATIC_DISCOVERY_RANGE", "RMW_IMPLEMENTATION", "FASTRTPS_DEFAULT_PROFILES_FILE", "ROS_HOME"):
        os.environ[k] = env[k]  # the in-process listener's middleware
    listener = None
    if not args.no_listener:
        try:
            listener = ActionListener(args.domain_id)
        except Exception as exc:  # the sweep still runs without the action comparison
            print(f"vla_sweep: action listener unavailable ({exc}); action error not measured", file=sys.stderr)
    results: dict[str, dict[str, dict]] = {}
    try:
        for setting in settings:
            for policy in policies:
                print(f"vla_sweep: {setting} / {policy}: {args.duration:g} s ...", flush=True)
                r = run_once(bag, policy, setting, args.duration, out, env, args.backend, args.checkpoint,
                             instruction, listener, args.camera_hz, args.startup_timeout, extra)
                results.setdefault(setting, {})[policy] = r
                if r["error"]:
                    print(f"  FAILED: {r['error']}", file=sys.stderr, flush=True)
                print(f"  admitted {r['chunks']['admitted']} refused {r['chunks']['refused']} misses "
                      f"{r['chunks']['deadline_misses']} p99 {_fmt(r['latency_ms']['p99'])} ms", flush=True)
    finally:
        if listener is not None:
            listener.close()
    for policy in policies:
        doc = {"policy": policy, "settings": {s: results[s][policy] for s in settings if policy in results.get(s, {})}}
        (out / f"{policy}.json").write_text(json.dumps(doc, indent=2, default=str))
    backends = sorted({str(r.get("backend")) for by in results.values() for r in by.values()})
    cmd = f"python -m vla_edge_ros.bench.sweep --duration {args.duration:g}" + (f" --bag {args.bag}" if args.bag
                                                                               else "") + f" --out {args.out}"
    if args.backend != "auto":
        cmd += f" --backend {args.backend}"
    if args.weight_dtype:
        cmd += f" --weight-dtype {args.weight_dtype}"
    meta = {"bag": str(bag) if args.bag else "", "bag_description": desc,
            "camera_hz": args.camera_hz, "duration": args.duration, "backend_used": ", ".join(backends),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}",
            "command": f"make sweep DURATION={args.duration:g}" + (f" BAG={args.bag}" if args.bag else "")
            + f"\n# or: {cmd}"}
    make_plots(results, out)
    report = write_report(results, out, meta)
    print(report.read_text())
    failed = [f"{s}/{p}" for s, by in results.items() for p, r in by.items() if r.get("error")]
    if failed:
        print(f"vla_sweep: {len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
