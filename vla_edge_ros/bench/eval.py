"""`vla_eval` (`make eval`): task success of the closed loop, N episodes per setting, through real ROS 2 processes.

    python -m vla_edge_ros.bench.eval [--quick] [--checkpoint DIR] [--episodes 10] [--tasks push]
        [--policies semantic,fifo] [--kv-budgets small,0] [--deadlines 33] [--latencies 0,50]
        [--backends numpy] [--baselines expert,random,hold] [--out results/eval]

Why real processes and wall-clock time: what a fresh action, a refused chunk, an eviction or a deadline does to a
robot only shows when the sim keeps moving while the policy thinks. Per setting this starts ``vla_runtime --role
all`` (its own ROS_DOMAIN_ID and ROS_HOME, ``--stats-out``), waits until inference is active, then starts
``vla_sim`` with ``num_episodes=N`` from a fixed ``seed_start`` (so every setting sees the same initial states);
the sim runs the episodes back to back and exits, the runtime is stopped with SIGINT and writes its figures.
The expert / hold baselines run ``vla_sim`` alone with ``sim_policy`` expert / hold: the same 7 -> 4 mapping and
control timing, no runtime. Extra chunk latency is injected with ``VLA_FAULT_INJECT=hang:<ms>@1+`` in the
runtime's environment (engine/fault_injection.py; the runtime log's banner is checked).

The progress bar (tqdm) counts episodes as the sim appends them to its JSON-lines file. A setting whose processes
fail (start-up, a crash, a timeout, fewer episodes) is a FAILED row with its reason and log directory, never
dropped; the exit code is then 1. Outputs under ``--out``: results.json (rewritten after every setting),
report.md, success_vs_latency.png, success_by_setting.png, logs/<nn>_<setting>/ (params, logs, episodes, stats).
The pure parts (grid, Wilson interval, rows) are bench/eval_grid.py, the report and plots bench/eval_report.py.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from vla_edge_ros import params as registry
from vla_edge_ros.bench.eval_grid import BASELINES, Setting, aggregate, expand_grid, read_episode_lines
from vla_edge_ros.bench.eval_report import make_plots, render_report
from vla_edge_ros.bench.procs import ROOT, Child, ros_child_env, wait_active
from vla_edge_ros.engine.fault_injection import ENV_VAR as FAULT_ENV_VAR
from vla_edge_ros.sim.tasks import TASK_KEYS

FAULT_BANNER = "FAULT INJECTION ENABLED"  # engine/fault_injection.wrap_from_env
DEFAULT_DOMAIN_ID = 150  # settings take DEFAULT_DOMAIN_ID, +1, ... (wrapping below 233); tests use 10-99
DEFAULT_SEED_START = 100000  # held out: far from the seeds demonstrations are recorded from (0, 1, ...)
# --quick: the CI-sized run. Horizon 60: the reach expert needs 34-61 steps (seeds 100000/100001: see the test).
QUICK = {"episodes": 2, "tasks": "reach", "policies": "semantic", "kv_budgets": "small", "deadlines": "33",
         "latencies": "0", "backends": "numpy", "horizon": 60, "camera_hz": 5.0, "image_size": 64}
FULL = {"episodes": 10, "tasks": registry.BY_NAME["task"].default, "policies": "semantic,fifo",
        "kv_budgets": "small", "deadlines": str(registry.BY_NAME["deadline_ms"].default), "latencies": "0,50",
        "backends": "numpy", "horizon": registry.BY_NAME["horizon"].default,
        "camera_hz": registry.BY_NAME["camera_hz"].default, "image_size": registry.BY_NAME["image_width"].default}


@dataclass(frozen=True)
class RunConfig:
    episodes: int
    horizon: int
    camera_hz: float
    control_hz: float
    image_width: int
    image_height: int
    seed_start: int
    checkpoint: str
    startup_timeout_s: float
    domain_id: int
    camera_deadline_ms: float  # must exceed the camera period, else every frame gap reads as a stall
    stale_after_ms: float  # idem: the action publisher holds once the newest frame is older than this
    runtime_params: tuple[str, ...] = ()  # extra NAME:=VALUE for vla_runtime
    camera_after_control: bool = False  # vla_sim renders right after the control steps (phase-locked camera)

    def episode_budget_s(self) -> float:
        """Generous wall-clock limit for the sim's N episodes (a slow 2-core machine stretches control ticks)."""
        return self.episodes * self.horizon / self.control_hz * 2.0 + 60.0


class EpisodeTail:
    """New complete lines of a JSON-lines file being appended to (the progress bar's source)."""

    def __init__(self, path: Path):
        self.path, self._offset, self.count = Path(path), 0, 0
        self.successes = 0

    def new_lines(self) -> list[bytes]:
        """The non-blank complete lines appended since the last call (none while the file is absent)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1  # only whole lines: the sim may be mid-write
        self._offset += end
        return [line for line in data[:end].splitlines() if line.strip()]

    def poll(self) -> int:
        lines = self.new_lines()
        for line in lines:
            try:
                self.successes += bool(json.loads(line).get("success"))
            except (ValueError, AttributeError):
                pass  # counted as an episode; aggregate() reports the bad line
        self.count += len(lines)
        return len(lines)


class Progress:
    """tqdm over all episodes of the run; plain lines when tqdm is missing or output is not wanted."""

    def __init__(self, total: int, enabled: bool = True):
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="ep", desc="vla_eval", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, n: int, postfix: str) -> None:
        if self.bar is not None:
            self.bar.update(n)
            self.bar.set_postfix_str(postfix, refresh=True)

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _yaml(path: Path, doc: dict) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(doc, sort_keys=True))
    return path


def runtime_overrides(setting: Setting, cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """The per-setting runtime parameters (on top of config/runtime.yaml), checked against the registry."""
    inference = {"backend": setting.backend, "eviction_policy": setting.eviction_policy,
                 "kv_budget_tokens": setting.kv_budget_tokens, "deadline_ms": float(setting.deadline_ms),
                 "instruction": setting.instruction, "checkpoint": setting.checkpoint}
    camera = {"camera_deadline_ms": float(cfg.camera_deadline_ms)}
    # a chunk's steps are the sim's control steps (the period the policy was trained at); the publisher stays faster
    action = {"stale_after_ms": float(cfg.stale_after_ms), "chunk_step_hz": float(cfg.control_hz)}
    reasons = registry.validate_all({**inference, **camera, **action},
                                    prefix_tokens=len(setting.instruction.encode("utf-8")))
    if reasons:
        raise ValueError(f"runtime parameters of {setting.label} rejected: {'; '.join(reasons)}")
    return {registry.INFERENCE: inference, registry.CAMERA: camera, registry.ACTION: action}


def sim_parameters(setting: Setting, cfg: RunConfig, results_path: Path,
                   extra: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """vla_sim's parameters of a setting; ``extra`` adds others (the demo's video_path), checked the same way."""
    values = {"task": setting.task, "camera_hz": float(cfg.camera_hz), "control_hz": float(cfg.control_hz),
              "image_width": cfg.image_width, "image_height": cfg.image_height, "horizon": cfg.horizon,
              "seed_start": cfg.seed_start, "num_episodes": cfg.episodes, "wait_for_action": True,
              "results_path": str(results_path), "camera_after_control": bool(cfg.camera_after_control),
              **(extra or {})}
    reasons = [r for n, v in values.items() if (r := registry.validate(n, v))]
    if reasons:
        raise ValueError(f"sim parameters rejected: {'; '.join(reasons)}")
    values["sim_policy"] = "external" if setting.kind == "model" else setting.kind
    return values


def domain_for(index: int, base: int) -> int:
    return base + index % (233 - base)


def run_setting(setting: Setting, index: int, cfg: RunConfig, out: Path, progress: Progress,
                base_env: Optional[dict] = None, sim_extra: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Run one setting's processes; returns its row (failed rows included)."""
    logs = out / "logs" / f"{index:02d}_{setting.slug}"
    logs.mkdir(parents=True, exist_ok=True)
    episodes_path, rt_stats_path = logs / "episodes.jsonl", logs / "runtime_stats.json"
    for p in (episodes_path, rt_stats_path):
        p.unlink(missing_ok=True)
    env = ros_child_env(domain_for(index, cfg.domain_id), logs / "ros_home", base=base_env)
    env.pop(FAULT_ENV_VAR, None)  # an operator's fault spec must not leak into a setting that injects nothing
    if setting.kind == "model" and setting.inject_ms > 0:
        env[FAULT_ENV_VAR] = f"hang:{setting.inject_ms:g}@1+"
    py = sys.executable
    sim_yaml = _yaml(logs / "sim.params.yaml",
                     {registry.SIM: {"ros__parameters": sim_parameters(setting, cfg, episodes_path, sim_extra)}})
    tail = EpisodeTail(episodes_path)
    failure: Optional[str] = None
    runtime: Optional[Child] = None
    sim: Optional[Child] = None
    t0 = time.monotonic()

    def advance() -> None:
        n = tail.poll()
        if n:
            progress.update(n, f"setting {index + 1} ({setting.slug}): {tail.successes}/{tail.count} succeeded")

    try:
        if setting.kind == "model":
            rt_yaml = _yaml(logs / "runtime.params.yaml", {node: {"ros__parameters": v} for node, v in
                                                         runtime_overrides(setting, cfg).items()})
            cmd = [py, "-m", "vla_edge_ros.ros.runtime", "--role", "all", "--stats-out", str(rt_stats_path),
                   "--stats-every-s", "2.0", "--ros-args", "--params-file", str(ROOT / "config" / "runtime.yaml"),
                   "--params-file", str(rt_yaml)]
            for p in cfg.runtime_params:
                cmd += ["-p", p]
            (logs / "runtime.cmd").write_text(shlex.join(cmd) + "\n")
            # cwd=None: a relative --checkpoint stays relative to where the eval was started
            runtime = Child(cmd, env, logs / "runtime.log", name="vla_runtime", cwd=None)
            not_active = wait_active(runtime, cfg.startup_timeout_s)
            if not_active:
                raise _SettingFailed(not_active)
            if setting.inject_ms > 0 and FAULT_BANNER not in runtime.output():
                raise _SettingFailed(f"{FAULT_ENV_VAR} was set but the runtime did not enable fault injection "
                                     f"(see {logs / 'runtime.log'})")
        cmd = [py, "-m", "vla_edge_ros.ros.sim_node", "--stats-out", str(logs / "sim_stats.json"), "--ros-args",
               "--params-file", str(sim_yaml)]
        (logs / "sim.cmd").write_text(shlex.join(cmd) + "\n")
        sim = Child(cmd, env, logs / "sim.log", name="sim", cwd=None)
        t_end = time.monotonic() + cfg.episode_budget_s() + (cfg.startup_timeout_s if runtime is None else 30.0)
        while sim.alive():
            advance()
            if runtime is not None and not runtime.alive():
                raise _SettingFailed(f"vla_runtime exited with {runtime.p.returncode} during the episodes "
                                     f"(see {logs / 'runtime.log'})")
            if time.monotonic() > t_end:
                raise _SettingFailed(f"the sim did not finish {cfg.episodes} episodes in "
                                     f"{time.monotonic() - t0:.0f} s (see {logs / 'sim.log'})")
            time.sleep(0.5)
        if sim.p.returncode != 0:
            raise _SettingFailed(f"vla_sim exited with {sim.p.returncode} (see {logs / 'sim.log'})")
    except _SettingFailed as exc:
        failure = str(exc)
    finally:
        for child in (sim, runtime):
            if child is not None:
                child.interrupt()
        if sim is not None and sim.stop(20) == -9 and failure is None:
            failure = f"vla_sim did not exit on SIGINT (see {logs / 'sim.log'})"
        if runtime is not None:
            rc = runtime.stop(30)
            if rc != 0 and failure is None:
                failure = f"vla_runtime exited with {rc} at shutdown (see {logs / 'runtime.log'})"
    advance()
    wall_s = time.monotonic() - t0
    try:
        text = episodes_path.read_text()
    except OSError:
        text = ""
    episodes, problems = read_episode_lines(text)
    stats = None
    if setting.kind == "model":
        try:
            stats = json.loads(rt_stats_path.read_text())
        except (OSError, ValueError):
            stats = None
    row = aggregate(setting, episodes, stats, cfg.episodes, cfg.seed_start, failure, problems, str(logs), wall_s)
    missing = cfg.episodes - tail.count
    if missing > 0:  # keep the bar's total honest for the settings still to come
        progress.update(missing, f"setting {index + 1} ({setting.slug}): FAILED")
    return row


class _SettingFailed(RuntimeError):
    pass


def _csv(text: str) -> list[str]:
    return [x.strip() for x in str(text).split(",") if x.strip()]


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="vla_eval", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the CI-sized run: " + json.dumps(QUICK))
    ap.add_argument("--checkpoint", default="", help="checkpoint directory (empty: the embedded random weights)")
    ap.add_argument("--episodes", type=int, help=f"episodes per setting (default {FULL['episodes']})")
    ap.add_argument("--tasks", help=f"comma list of {', '.join(TASK_KEYS)} (default {FULL['tasks']})")
    ap.add_argument("--policies", help=f"eviction policies (default {FULL['policies']})")
    ap.add_argument("--kv-budgets", dest="kv_budgets", help="kv_budget_tokens values; 0 = the backend's default, "
                    "'small' = prefix + 4 frames, so eviction starts in the first second "
                    f"(default {FULL['kv_budgets']})")
    ap.add_argument("--deadlines", help=f"deadline_ms values (default {FULL['deadlines']})")
    ap.add_argument("--latencies", help=f"injected extra chunk latency, ms (default {FULL['latencies']}; "
                    "e.g. 0,20,50,100)")
    ap.add_argument("--backends", help=f"numpy, cuda (default {FULL['backends']})")
    ap.add_argument("--baselines", default=",".join(BASELINES), help="expert, random, hold (or 'none')")
    ap.add_argument("--baselines-only", action="store_true",
                    help="run the baselines' settings alone (e.g. more expert episodes than model ones)")
    ap.add_argument("--horizon", type=int, help=f"control steps per episode (default {FULL['horizon']})")
    ap.add_argument("--camera-hz", dest="camera_hz", type=float, help=f"default {FULL['camera_hz']:g}")
    ap.add_argument("--control-hz", dest="control_hz", type=float, default=registry.BY_NAME["control_hz"].default)
    ap.add_argument("--image-size", dest="image_size", type=int, help=f"square image px (default {FULL['image_size']})")
    ap.add_argument("--image-wh", type=int, nargs=2, metavar=("W", "H"), default=None,
                    help="a non-square image instead (a trained policy's size, e.g. 128 64: its deploy block)")
    ap.add_argument("--camera-after-control", dest="camera_after_control", action="store_true",
                    help="vla_sim renders right after every k-th control step (k = control_hz / camera_hz): each "
                         "frame shows what the last action did, as in the synchronous loop")
    ap.add_argument("--seed-start", dest="seed_start", type=int, default=DEFAULT_SEED_START)
    ap.add_argument("--runtime-param", dest="runtime_params", action="append", default=[], metavar="NAME:=VALUE",
                    help="extra vla_runtime parameter (repeatable)")
    ap.add_argument("--domain-id", dest="domain_id", type=int, default=DEFAULT_DOMAIN_ID,
                    help="ROS_DOMAIN_ID of the first setting; each further setting takes the next one")
    ap.add_argument("--startup-timeout", dest="startup_timeout", type=float, default=180.0)
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    ap.add_argument("--out", default="results/eval")
    args = ap.parse_args(list(argv) if argv is not None else None)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def build(args: argparse.Namespace) -> tuple[list[Setting], RunConfig]:
    """Settings and the run configuration from the parsed flags; ValueError with the reason otherwise."""
    if args.episodes < 1 or args.horizon < 1:
        raise ValueError("--episodes and --horizon must be >= 1")
    if not 0 <= args.domain_id <= 232:
        raise ValueError(f"--domain-id must be in 0..232, got {args.domain_id}")
    for p in args.runtime_params:
        if ":=" not in p:
            raise ValueError(f"--runtime-param wants NAME:=VALUE, got {p!r}")
        if p.split(":=", 1)[0] not in registry.BY_NAME:
            raise ValueError(f"--runtime-param: unknown parameter {p.split(':=', 1)[0]!r}")
    baselines = [] if args.baselines.strip() == "none" else _csv(args.baselines)
    if args.checkpoint:
        from vla_edge_ros.engine import shipped
        args.checkpoint = str(shipped.resolve(args.checkpoint))  # a path or a shipped name (a ValueError if neither)
        if not Path(args.checkpoint).is_dir():
            raise ValueError(f"--checkpoint {args.checkpoint} is not a directory")
    settings = expand_grid(_csv(args.tasks), _csv(args.policies), _csv(args.kv_budgets),
                           [float(x) for x in _csv(args.deadlines)], [float(x) for x in _csv(args.latencies)],
                           _csv(args.backends), baselines, args.checkpoint)
    if args.baselines_only:
        settings = [st for st in settings if st.baseline]
        if not settings:
            raise ValueError("--baselines-only with --baselines none leaves nothing to run")
    period_ms = 1000.0 / args.camera_hz
    cfg = RunConfig(episodes=args.episodes, horizon=args.horizon, camera_hz=args.camera_hz,
                    control_hz=args.control_hz, image_width=args.image_wh[0] if args.image_wh else args.image_size,
                    image_height=args.image_wh[1] if args.image_wh else args.image_size,
                    seed_start=args.seed_start, checkpoint=args.checkpoint, startup_timeout_s=args.startup_timeout,
                    domain_id=args.domain_id, camera_deadline_ms=max(3.0 * period_ms, 200.0),
                    stale_after_ms=max(3.0 * period_ms, 200.0), runtime_params=tuple(args.runtime_params),
                    camera_after_control=bool(args.camera_after_control))
    return settings, cfg


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        settings, cfg = build(args)
    except ValueError as exc:
        print(f"vla_eval: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = "python -m vla_edge_ros.bench.eval " + shlex.join(list(argv) if argv is not None else sys.argv[1:])
    meta = {"command": cmd.strip(), "config": asdict(cfg),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}",
            "load_avg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "settings": [s.label for s in settings]}
    print(f"vla_eval: {len(settings)} settings x {cfg.episodes} episodes (horizon {cfg.horizon}, camera "
          f"{cfg.camera_hz:g} Hz {cfg.image_width} px, control {cfg.control_hz:g} Hz); logs in {out / 'logs'}",
          flush=True)
    progress = Progress(len(settings) * cfg.episodes, enabled=args.progress)
    rows: list[dict] = []
    t0 = time.monotonic()

    def save() -> dict:
        load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
        doc = {"meta": {**meta, "wall_s": time.monotonic() - t0, "load_avg_now": load}, "rows": rows}
        (out / "results.json").write_text(json.dumps(doc, indent=2, default=str))
        return doc

    try:
        for i, setting in enumerate(settings):
            row = run_setting(setting, i, cfg, out, progress)
            rows.append(row)
            save()
            progress.write(f"{row['label']}: {row['successes']}/{row['episodes']} succeeded"
                           + ("" if row["status"] == "ok" else f"  FAILED: {row['error']}"))
    except KeyboardInterrupt:
        progress.write("vla_eval: interrupted; writing the settings that finished")
    finally:
        progress.close()
    doc = save()
    (out / "report.md").write_text(render_report(doc))
    if rows:
        make_plots(rows, out)
    print(render_report(doc))
    print(f"vla_eval: wrote {out / 'results.json'}, {out / 'report.md'} and plots in {time.monotonic() - t0:.0f} s")
    if len(rows) < len(settings) or any(r["status"] != "ok" for r in rows):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
