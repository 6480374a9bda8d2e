"""`python -m vla_edge_ros.bench.demo --sim`: the demo in closed loop -- a policy drives the simulated arm.

    python -m vla_edge_ros.bench.demo --sim [--checkpoint DIR] [--task drawer-close] [--episodes 5]
        [--out results/demo.json] [--video results/demo_episode.gif]

Why a closed-loop demo beside the open-loop one (bench/demo.py): the open loop shows that actions are on time;
only the closed loop shows what they do -- whether the arm solves the task while the policy thinks in wall-clock
time. This runs ``vla_runtime`` + ``vla_sim`` as real ROS processes through the evaluation's runner
(bench/eval.py ``run_setting``: own ROS domain and ROS_HOME, the runtime active before the sim starts, every
failure a reason), prints one line per episode as the sim reports it (success, steps, duration, the shares of
fresh / repeat / hold among the applied steps), then a summary (success rate with its 95 % interval, chunk
latency p50 / p99, deadline misses, fresh share), writes the ``closed_loop`` section of ``--out`` (the other
sections of that file, the open-loop demo's figures, are kept) and has the sim record the first episode as a GIF
with the action kind drawn on every frame (sim/episode_video.py; ``--video ''`` turns it off).

Settings: a trained checkpoint's ``training_record.json`` says how it must be deployed (its ``deploy`` block:
image size, eviction policy, retained frames, tokens per frame; rates and deadline when it records them); what
it does not say takes the CPU-safe settings below, with which the H200-trained policy closes drawers on the
2-core CPU (9/10, bench/eval.py with the same values). A flag overrides both. Each value's source is printed and
kept in the JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from vla_edge_ros import params as registry
from vla_edge_ros.bench.eval_grid import Setting
from vla_edge_ros.engine import shipped
from vla_edge_ros.sim.tasks import TASK_KEYS

# The CPU-safe closed-loop settings: a 10 Hz camera, control and action rate leave the 2-core CPU room for a chunk
# of the 4.8 M-parameter policy (100 ms deadline) and the renders; the camera deadline and staleness limit are
# a few camera periods, so a slow frame is not a stall. The image, policy and window are those the H200 policy
# was trained for (results/policy_h200_v2: 64x128, sliding_window of 2 frames).
CPU_SAFE: dict[str, Any] = {"camera_hz": 10.0, "control_hz": 10.0, "action_rate_hz": 10.0, "image_width": 128,
                            "image_height": 64, "eviction_policy": "sliding_window", "window_frames": 2,
                            "deadline_ms": 100.0, "camera_deadline_ms": 300.0, "stale_after_ms": 500.0,
                            "camera_after_control": False}
RECORD = "training_record.json"
DEMO_DOMAIN_ID = 149  # not the operator's 0, below the eval's 150 + i
DEFAULT_VIDEO = "results/demo_episode.gif"


def deploy_settings(checkpoint: str, flags: Optional[dict[str, Any]] = None) -> tuple[dict[str, Any], dict[str, str]]:
    """(values, source of each value): a flag, else the checkpoint's deploy block, else CPU_SAFE.

    The deploy block (train/trainer.py) has ``image_hw`` [H, W], ``eviction_policy``, ``window_frames``,
    ``tokens_per_frame``; any of CPU_SAFE's names it carries (a rate, the deadline) is taken as well. A record
    that is not JSON, or a deploy value the registry rejects, is an error (ValueError), not a silent fallback."""
    values, sources = dict(CPU_SAFE), {k: "CPU-safe default" for k in CPU_SAFE}
    deploy: dict[str, Any] = {}
    if checkpoint:
        path = Path(checkpoint) / RECORD
        if path.exists():
            try:
                deploy = json.loads(path.read_text(encoding="utf-8")).get("deploy") or {}
            except (ValueError, AttributeError) as exc:
                raise ValueError(f"{path} is not a JSON training record: {exc}") from None
    found: dict[str, Any] = {k: deploy[k] for k in (*CPU_SAFE, "tokens_per_frame") if k in deploy}
    if "image_hw" in deploy:
        try:
            found["image_height"], found["image_width"] = (int(x) for x in deploy["image_hw"])
        except (TypeError, ValueError):
            raise ValueError(f"{checkpoint}/{RECORD}: deploy.image_hw must be [H, W], got {deploy['image_hw']!r}")
    for name, value in found.items():
        values[name], sources[name] = value, f"checkpoint ({RECORD} deploy)"
    # a shipped policy's manifest says how it was evaluated on a 2-core CPU (engine/shipped.py)
    manifest = Path(checkpoint) / shipped.MANIFEST if checkpoint else None
    if manifest is not None and manifest.is_file():
        for name, value in (json.loads(manifest.read_text(encoding="utf-8")).get("deploy_cpu") or {}).items():
            if name not in CPU_SAFE:
                raise ValueError(f"{manifest}: deploy_cpu.{name} is not a demo setting ({', '.join(CPU_SAFE)})")
            values[name], sources[name] = value, f"shipped policy ({shipped.MANIFEST} deploy_cpu)"
    for name, value in (flags or {}).items():
        if value is not None:
            values[name], sources[name] = value, "flag"
    for name in ("camera_hz", "control_hz", "action_rate_hz", "deadline_ms", "camera_deadline_ms", "stale_after_ms"):
        values[name] = float(values[name])
    reasons = [r for n, v in values.items() if (r := registry.validate(n, v))]
    if reasons:
        raise ValueError("; ".join(reasons))
    return values, sources


def applied_shares(ep: dict) -> dict[str, float]:
    """Shares of the episode's applied steps by kind (the sim's own holds as 'sim_hold')."""
    steps = max(1, int(ep.get("steps", 0)))
    shares = {k: int(ep.get(k, 0)) / steps for k in ("fresh", "repeat", "hold")}
    shares["sim_hold"] = sum((ep.get("sim_hold") or {}).values()) / steps
    return shares


def episode_line(ep: dict) -> str:
    s = applied_shares(ep)
    outcome = "SUCCESS" if ep.get("success") else f"failed ({ep.get('end') or '?'})"
    sim_hold = f" sim-hold {s['sim_hold']:.0%}" if s["sim_hold"] else ""
    return (f"episode {ep.get('episode', '?')} seed {ep.get('seed', '?')}: {outcome} after {ep.get('steps')} "
            f"steps, {float(ep.get('duration_s', 0.0)):.1f} s | applied fresh {s['fresh']:.0%} repeat "
            f"{s['repeat']:.0%} hold {s['hold']:.0%}{sim_hold}")


class EpisodePrinter:
    """Prints each episode line as the sim appends it (eval.run_setting's progress interface)."""

    def __init__(self, path: Path):
        from vla_edge_ros.bench.eval import EpisodeTail  # eval's reader of whole appended lines (lazy, as in main)

        self._tail = EpisodeTail(path)
        self.episodes: list[dict] = []
        self.bad_lines = 0

    def poll(self) -> None:
        for line in self._tail.new_lines():
            try:
                ep = json.loads(line)
            except ValueError:
                self.bad_lines += 1  # aggregate() reports it as a problem of the run
                print(f"vla_demo: episode line not JSON: {line[:80]!r}", flush=True)
                continue
            self.episodes.append(ep)
            print(episode_line(ep), flush=True)

    def update(self, n: int, postfix: str) -> None:
        self.poll()

    def write(self, text: str) -> None:
        print(text, flush=True)

    def close(self) -> None:
        pass


def closed_loop_section(row: dict, episodes: Sequence[dict], values: dict, sources: dict, video: Optional[dict],
                        command: str) -> dict[str, Any]:
    rt = row.get("runtime") or {}
    ticks = rt.get("ticks") or {}
    n_ticks = sum(v or 0 for v in ticks.values())
    return {
        "status": row["status"], "error": row["error"], "task": row["setting"]["task"],
        "instruction": Setting(**row["setting"]).instruction, "checkpoint": row["setting"]["checkpoint"],
        "episodes": row["episodes"], "successes": row["successes"], "success_rate": row["success_rate"],
        "success_ci95": row["success_ci95"], "episode_s": row["episode_s"], "steps_mean": row["steps_mean"],
        "applied_shares": row["shares"], "fresh_share": (row["shares"] or {}).get("fresh"),
        "sim_hold_by_reason": row["sim_hold_by_reason"], "actions_rejected": row["actions_rejected"],
        "chunks": rt.get("chunks"), "chunk_latency_ms": rt.get("latency_ms"),
        "deadline_miss_rate": rt.get("deadline_miss_rate"), "runtime_ticks": ticks,
        "runtime_repeat_reasons": rt.get("repeat_reasons") or {},
        "runtime_fresh_share": (ticks.get("fresh") or 0) / n_ticks if n_ticks else None,
        "per_episode": [{k: e.get(k) for k in ("episode", "seed", "success", "end", "steps", "duration_s",
                                                "fresh", "repeat", "hold", "sim_hold")} for e in episodes],
        "settings": {**values, "backend": row["setting"]["backend"], "sources": sources},
        "video": video, "logs": row["logs"], "wall_s": row["wall_s"], "command": command,
    }


def summary_text(sec: dict) -> str:
    def pct(x):
        return "n/a" if x is None else f"{x:.0%}"

    def ms(x):
        return "n/a" if x is None else f"{float(x):.1f}"

    sh, ch, lat = sec["applied_shares"] or {}, sec["chunks"] or {}, sec["chunk_latency_ms"] or {}
    reasons = sec.get("runtime_repeat_reasons") or {}
    ci = sec["success_ci95"]
    video = sec["video"] or {}
    rows = [
        ("task / checkpoint",
         f"{sec['task']} ('{sec['instruction']}') / {sec['checkpoint'] or 'embedded random weights'}"),
        ("success", f"{sec['successes']}/{sec['episodes']} ({pct(sec['success_rate'])}"
                    + (f", 95 % CI {ci[0]:.0%}-{ci[1]:.0%})" if ci else ")")),
        ("episode time mean / steps mean", f"{ms((sec['episode_s'] or {}).get('mean'))} s / {ms(sec['steps_mean'])}"),
        ("applied fresh / repeat / hold / sim-hold",
         " / ".join(pct(sh.get(k)) for k in ("fresh", "repeat", "hold", "sim_hold"))),
        ("runtime ticks fresh share", pct(sec["runtime_fresh_share"])),
        ("runtime repeats by reason", ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())) or "none"),
        ("chunks admitted / refused / deadline misses",
         f"{ch.get('admitted', 'n/a')} / {ch.get('refused', 'n/a')} / {ch.get('deadline_misses', 'n/a')}"
         f" ({pct(sec['deadline_miss_rate'])} of admitted)"),
        ("chunk latency p50 / p99 (ms)", f"{ms(lat.get('p50'))} / {ms(lat.get('p99'))}"),
        ("video", f"{video.get('path')} ({video.get('frames')} frames, {video.get('bytes', 0) / 1024:.0f} KiB)"
                  if video.get("written") else (video.get("error") or "off")),
    ]
    w = max(len(k) for k, _ in rows)
    line = "-" * (w + 40)
    out = [line] + [f"{k:<{w}}  {v}" for k, v in rows] + [line]
    if sec["status"] != "ok":
        out.append(f"FAILED: {sec['error']} (logs in {sec['logs']})")
    if not sec["checkpoint"]:
        out.append("NOTE: no --checkpoint: random weights are not expected to solve the task")
    if reasons.get("next_step"):
        out.append("NOTE: action chunks: a chunk's later steps count as 'repeat' (reason next_step): the arm plays "
                   "the plan, it does not re-send an old action")
    return "\n".join(out)


def merge_into(path: Path, section: dict[str, Any]) -> None:
    """Set the ``closed_loop`` key of the JSON object at ``path``, keeping its other keys; an unreadable file is
    kept beside as <name>.unreadable (said so), never silently overwritten."""
    doc: dict[str, Any] = {}
    if path.exists():
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(doc, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            keep = path.with_name(path.name + ".unreadable")
            os.replace(path, keep)
            print(f"vla_demo: {path} was unreadable ({exc}); kept as {keep}", file=sys.stderr)
            doc = {}
    doc["closed_loop"] = section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, default=str))


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="vla_demo --sim", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="", help="trained checkpoint directory or shipped policy name "
                    "(metaworld_mt3; empty: embedded random weights)")
    ap.add_argument("--task", default="drawer-close", choices=TASK_KEYS)
    ap.add_argument("--episodes", type=int, default=5)
    ap.add_argument("--horizon", type=int, default=registry.BY_NAME["horizon"].default)
    ap.add_argument("--seed-start", type=int, default=0)
    ap.add_argument("--backend", default="auto", choices=registry.BACKENDS)
    ap.add_argument("--camera-hz", type=float, default=None, help=f"default {CPU_SAFE['camera_hz']:g}")
    ap.add_argument("--control-hz", type=float, default=None, help=f"default {CPU_SAFE['control_hz']:g}")
    ap.add_argument("--action-rate-hz", type=float, default=None, help=f"default {CPU_SAFE['action_rate_hz']:g}")
    ap.add_argument("--deadline-ms", type=float, default=None, help=f"default {CPU_SAFE['deadline_ms']:g}")
    ap.add_argument("--image-wh", type=int, nargs=2, metavar=("W", "H"), default=None)
    ap.add_argument("--out", default="results/demo.json", help="JSON whose closed_loop section is written")
    ap.add_argument("--video", default=DEFAULT_VIDEO, help="GIF of the first episode ('' = none)")
    ap.add_argument("--workdir", default="", help="the run's logs go to its logs/ folder (default: a new temporary "
                    "directory)")
    ap.add_argument("--domain-id", type=int, default=DEMO_DOMAIN_ID)
    ap.add_argument("--startup-timeout", type=float, default=180.0)
    return ap.parse_args(list(argv) if argv is not None else None)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from vla_edge_ros.bench import eval as vla_eval

    args = parse_args(argv)
    flags = {"camera_hz": args.camera_hz, "control_hz": args.control_hz, "action_rate_hz": args.action_rate_hz,
             "deadline_ms": args.deadline_ms,
             "image_width": args.image_wh[0] if args.image_wh else None,
             "image_height": args.image_wh[1] if args.image_wh else None}
    try:
        if args.episodes < 1 or args.horizon < 1:
            raise ValueError("--episodes and --horizon must be >= 1")
        if args.checkpoint:
            args.checkpoint = str(shipped.resolve(args.checkpoint))  # ShippedPolicyError is a ValueError
            if not Path(args.checkpoint).is_dir():
                raise ValueError(f"--checkpoint {args.checkpoint} is not a directory")
        values, sources = deploy_settings(args.checkpoint, flags)
        setting = Setting("model", args.task, args.backend, values["eviction_policy"], 0,
                          values["deadline_ms"], 0.0, args.checkpoint)
    except ValueError as exc:
        print(f"vla_demo: {exc}", file=sys.stderr)
        return 2
    runtime_params = [f"window_frames:={values['window_frames']}", f"action_rate_hz:={values['action_rate_hz']}"]
    if "tokens_per_frame" in values:
        runtime_params.append(f"tokens_per_frame:={values['tokens_per_frame']}")
    cfg = vla_eval.RunConfig(
        episodes=args.episodes, horizon=args.horizon, camera_hz=values["camera_hz"], control_hz=values["control_hz"],
        image_width=values["image_width"], image_height=values["image_height"], seed_start=args.seed_start,
        checkpoint=args.checkpoint, startup_timeout_s=args.startup_timeout, domain_id=args.domain_id,
        camera_deadline_ms=values["camera_deadline_ms"], stale_after_ms=values["stale_after_ms"],
        runtime_params=tuple(runtime_params), camera_after_control=bool(values["camera_after_control"]))
    video_path = Path(args.video).resolve() if args.video else None
    sim_extra = {"video_path": str(video_path), "video_episode": 0} if video_path else None
    if video_path is not None:
        video_path.unlink(missing_ok=True)  # a GIF of an earlier run must not pass for this one's
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="vla_demo_sim_"))
    model = f"checkpoint {args.checkpoint}" if args.checkpoint else "embedded random weights"
    print(f"vla_demo: closed loop, task {args.task}, {args.episodes} episodes (horizon {args.horizon}), {model}; "
          f"logs in {work / 'logs'}")
    for name in sorted(values):
        print(f"  {name} = {values[name]}  ({sources[name]})")
    printer = EpisodePrinter(work / "logs" / f"00_{setting.slug}" / "episodes.jsonl")  # run_setting's layout
    t0 = time.monotonic()
    try:
        row = vla_eval.run_setting(setting, 0, cfg, work, printer, sim_extra=sim_extra)
    except KeyboardInterrupt:
        print("vla_demo: interrupted", file=sys.stderr)
        return 1
    printer.path = Path(row["logs"]) / "episodes.jsonl"
    printer.poll()  # the lines written after the last poll
    video = _video_info(Path(row["logs"]) / "sim_stats.json", video_path)
    command = "python -m vla_edge_ros.bench.demo --sim " + shlex.join(list(argv) if argv is not None else sys.argv[1:])
    section = closed_loop_section(row, printer.episodes, values, sources, video, command.strip())
    out = Path(args.out)
    merge_into(out, section)
    print(summary_text(section))
    print(f"vla_demo: wrote {out} (closed_loop) in {time.monotonic() - t0:.0f} s"
          + (f"; episode video {video['path']}" if video and video.get("written") else ""))
    if row["status"] != "ok" or (video_path is not None and not (video or {}).get("written")):
        return 1
    return 0


def _video_info(sim_stats: Path, video_path: Optional[Path]) -> Optional[dict]:
    """The sim's account of the video (its --stats-out), checked against the file."""
    if video_path is None:
        return None
    try:
        info = json.loads(sim_stats.read_text()).get("video") or {}
    except (OSError, ValueError) as exc:
        info = {"written": False, "error": f"no sim stats ({exc})"}
    if info.get("written") and not video_path.is_file():
        info = {**info, "written": False, "error": f"the sim reported {video_path} but it is not there"}
    elif not info.get("written") and not info.get("error"):
        info = {**info, "error": "the sim wrote no video (the first episode did not run?)"}
    return {**info, "path": str(video_path)}


if __name__ == "__main__":
    sys.exit(main())
