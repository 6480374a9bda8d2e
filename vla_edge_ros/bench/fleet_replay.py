"""Fleet replay (issue 24): one edge process serving N robots, each fed by its own replayed camera stream.

    python -m vla_edge_ros.bench.fleet_replay --robots 8 --duration 120 [--camera-hz 60] [--bag PATH]
        [--backend cuda --checkpoint DIR] [--kv-budget-tokens T] [--deadline-ms D] --out results/fleet_replay

Why: "one edge GPU serves a fleet" is a claim about the whole ROS path, not the engine alone (fleet_bench.py
times the batched pass in one process). Here every piece is its own process, as deployed: ONE
``vla_runtime --role edge -p robot_namespaces:=r1,...,rN`` (the fleet edge, ros/fleet_node.py), N
``vla_runtime --role robot`` (each under ``/<ns>``, as docs/OPERATIONS.md "One edge, many robots" runs them)
and N ``vla_bag_replay`` (the clip re-timed to ``--camera-hz``, looped, its camera topic remapped to
``/<ns><camera_topic>``). The replays start once the edge is active; the window is measured from the moment
every robot's frames reach the edge (after ``--settle-s`` more, when given: the replays' own start-up loads the
machine while the edge serves; what the edge counts then gets its own line), for ``--duration`` s; then replays,
edge and robots are stopped, in that order, with SIGINT (killed when they do not exit).

Figures over that window (every process's stats as the window closes, before anything stops), per robot: chunks
admitted / refused / deadline misses and the miss rate (the edge's per-robot fleet-loop counters), chunk latency
p50 / p99 (from the edge's cumulative histograms: the window's chunks only), ticks fresh / repeat / hold and the fresh
share (the robot process's own stats), its KV cache bytes (VRAM with backend cuda, host memory with numpy); frames
published / received are the whole replay's. For the edge: batch sizes, pass time and the host part of each
decision-to-results time (core/fleet_scheduler.py's cost model: its parts per batch size as the window ended), the
edge process's CPU time per second (Linux /proc), its fleet loop thread's share and its child processes' (the
fleet's camera process), weights and engine peak bytes; the figures and table are bench/fleet_report.py's. Verdict:
every robot's miss rate <= 0.1 % and every robot got fresh actions. Output: a table on stdout and in
``<out>/fleet_replay.md``, everything in ``<out>/fleet_replay.json``, logs in ``<out>/logs``. Exit code 0 when the
run worked (the verdict is reported, not returned); 1 when a process crashed or wrote no stats; 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Optional

from vla_edge_ros import params as registry
from vla_edge_ros.bench import host_load
from vla_edge_ros.bench.procs import Child, ros_child_env, wait_active
from vla_edge_ros.bench.fleet_report import counter_delta, edge_robot, settle_figures, summarise, table
from vla_edge_ros.bench.sweep import _get, _read_json, default_bag, first_instruction

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DOMAIN_ID = 58
RUNTIME = "vla_edge_ros.ros.runtime"
REPLAY = "vla_edge_ros.ros.tools.bag_replay"


# ---------------------------------------------------------------------------------------------------------------
# arguments and command lines
# ---------------------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vla_fleet_replay", description=__doc__.split("\n")[0])
    ap.add_argument("--robots", type=int, default=8, help="robots (namespaces r1..rN) served by the one edge")
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of replay measured")
    ap.add_argument("--camera-hz", type=float, default=60.0, help="each robot's camera rate (the clip re-timed)")
    ap.add_argument("--bag", default=None, help="bag to replay (default: sweep.py's clip)")
    ap.add_argument("--synthetic-size", default=None, metavar="HxW",
                    help="replay a synthetic clip of HxW JPEG frames instead (e.g. 480x640: VGA cameras)")
    ap.add_argument("--image-transport", default="raw", choices=("raw", "compressed"),
                    help="raw: the replays decode the JPEGs and publish rgb8 Images; compressed: they publish "
                         "the CompressedImages as they are and the edge's cameras decode them")
    ap.add_argument("--out", default="results/fleet_replay")
    ap.add_argument("--backend", default="auto", choices=registry.BACKENDS)
    ap.add_argument("--checkpoint", default="", help="checkpoint directory (default: the tiny built-in model)")
    ap.add_argument("--kv-budget-tokens", type=int, default=None, help="per robot (default: the registry's)")
    ap.add_argument("--deadline-ms", type=float, default=None, help="default: the registry's")
    ap.add_argument("--weight-dtype", default=None, choices=registry.BY_NAME["weight_dtype"].choices)
    ap.add_argument("--instruction", default=None, help="the fleet's instruction (default: the bag's first)")
    ap.add_argument("--param", action="append", default=[], metavar="NAME:=VALUE",
                    help="other edge parameter, passed as -p NAME:=VALUE (repeatable)")
    ap.add_argument("--domain-id", type=int, default=DEFAULT_DOMAIN_ID)
    ap.add_argument("--startup-timeout", type=float, default=300.0,
                    help="wait this long for the edge to be active (engine loaded, every batch size warmed up)")
    ap.add_argument("--settle-s", type=float, default=0.0,
                    help="seconds between every robot's frames reaching the edge and the window's start: the "
                         "replays' own start-up (N processes importing, opening the bag, decoding) loads the "
                         "machine's cores while the edge already serves; what the edge counts then is reported "
                         "on its own line, not in the table or the verdict")
    ap.add_argument("--stats-every-s", type=float, default=0.5, help="the robots rewrite their stats this often")
    ap.add_argument("--edge-stats-every-s", type=float, default=2.0,
                    help="the edge rewrites its stats this often: building them holds the GIL a pass needs (16 %% "
                         "of its holds at 0.5 s, docs/FIGURES.md session 22); the window's figures lag by as much")
    return ap


def parse_args(argv: Optional[Iterable[str]] = None) -> argparse.Namespace:
    """The options, checked (SystemExit 2 with the reason, as argparse does)."""
    ap = build_parser()
    args = ap.parse_args(list(argv) if argv is not None else None)
    problems = [p for p, bad in (("--robots must be >= 1", args.robots < 1), ("--duration must be > 0",
                                 args.duration <= 0), ("--camera-hz must be > 0", args.camera_hz <= 0),
                                 ("--domain-id must be in 0..232", not 0 <= args.domain_id <= 232),
                                 ("--settle-s must be >= 0", not args.settle_s >= 0),
                                 ("--stats-every-s and --edge-stats-every-s must be > 0",
                                  min(args.stats_every_s, args.edge_stats_every_s) <= 0))
                if bad]
    problems += [f"--param expects NAME:=VALUE, got {p!r}" for p in args.param if ":=" not in p]
    problems += [f"--param {p!r}: no such parameter" for p in args.param
                 if ":=" in p and p.split(":=", 1)[0] not in registry.BY_NAME]
    if args.synthetic_size is not None:
        try:
            h, w = (int(x) for x in args.synthetic_size.lower().split("x"))
            if not (8 <= h <= 4096 and 8 <= w <= 4096):
                raise ValueError
        except ValueError:
            problems.append(f"--synthetic-size expects HxW (8..4096 each), got {args.synthetic_size!r}")
        if args.bag:
            problems.append("--synthetic-size and --bag exclude each other")
    if problems:
        ap.error("; ".join(problems))
    return args


def namespaces(n: int) -> list[str]:
    return [f"r{i}" for i in range(1, n + 1)]


def robot_topic(ns: str, topic: str) -> str:
    """``/<ns>`` + the topic, as ros/fleet_node.robot_topic (not imported: no rclpy in this process)."""
    return f"/{ns}/{topic.strip('/')}"


def edge_values(args: argparse.Namespace, ns: list[str]) -> dict[str, Any]:
    """The edge's inference values given on the command line (``-p`` each), checked against the registry."""
    v: dict[str, Any] = {"robot_namespaces": ",".join(ns), "backend": args.backend}
    for key, value in (("checkpoint", args.checkpoint or None), ("kv_budget_tokens", args.kv_budget_tokens),
                       ("deadline_ms", args.deadline_ms), ("weight_dtype", args.weight_dtype)):
        if value is not None:
            v[key] = float(value) if key == "deadline_ms" else value  # -p 100 would be an int: a float param
    return v


def check_values(values: dict[str, Any], instruction: Optional[str]) -> list[str]:
    from vla_edge_ros.engine.geometry import prefix_token_ids

    v = {**registry.defaults(registry.INFERENCE), **values}
    if instruction:
        v["instruction"] = instruction
    return registry.validate_all(v, prefix_tokens=len(prefix_token_ids(v["instruction"])))


def next_write(path: Path, timeout_s: float, poll_s: float = 0.02) -> Optional[dict]:
    """The JSON a process writes to ``path`` (atomically, by rename) at its next write after this call, None when
    none comes within ``timeout_s``. A measured window opened and closed on the edge's writes covers what its
    counters count, to within ``poll_s``; read at a random moment they would be up to a stats period old at
    either end (the edge writes every --edge-stats-every-s)."""
    def mtime() -> int:
        try:
            return path.stat().st_mtime_ns
        except FileNotFoundError:
            return 0

    before, end = mtime(), time.monotonic() + timeout_s
    while time.monotonic() < end:
        time.sleep(poll_s)
        if mtime() != before:
            got = _read_json(path)
            if got is not None:
                return got
    return None


def edge_cmd(values: dict[str, Any], params_file: Path, stats: Path, run_s: float, stats_every_s: float,
             extra: Iterable[str] = ()) -> list[str]:
    ps = [x for k, v in values.items() for x in ("-p", f"{k}:={v}")] + [x for p in extra for x in ("-p", p)]
    return [sys.executable, "-m", RUNTIME, "--role", "edge", "--stats-out", str(stats), "--stats-every-s",
            str(stats_every_s), "--duration-s", f"{run_s:g}", "--ros-args", "--params-file", str(params_file), *ps]


def robot_cmd(ns: str, stats: Path, run_s: float, stats_every_s: float) -> list[str]:
    """The robot side as test/test_fleet_ros.py's robot_cmd and docs/OPERATIONS.md run it."""
    fresh = robot_topic(ns, registry.BY_NAME["fresh_action_topic"].default)
    return [sys.executable, "-m", RUNTIME, "--role", "robot", "--stats-out", str(stats), "--stats-every-s",
            str(stats_every_s), "--duration-s", f"{run_s:g}", "--fresh-action-topic", fresh, "--ros-args",
            "-r", f"__ns:=/{ns}", "-p", f"action_topic:=/{ns}/vla/action",
            "-p", f"action_status_topic:=/{ns}/vla/action_status",
            "-p", f"action_trajectory_topic:=/{ns}/vla/action_trajectory"]


def replay_topics(bag_topics: list[tuple[str, str]], camera_topic: str,
                  decode: bool = True) -> tuple[str, list[str]]:
    """(the replay's camera topic, every topic it publishes). ``decode`` (``--decode``): a compressed image topic
    is published as raw images without ``/compressed``, the camera is ``camera_topic`` when the bag has it, else
    its first image; without: the bag's topics as they are, the camera ``camera_topic``/compressed when the bag has
    it, else its first compressed image."""
    out = []
    for topic, msgtype in bag_topics:
        if decode and msgtype.endswith("CompressedImage"):
            topic = topic[:-len("/compressed")] if topic.endswith("/compressed") else topic + "/decoded"
        out.append(topic)
    kinds = ("/Image", "/CompressedImage") if decode else ("/CompressedImage",)
    images = [o for o, (_, t) in zip(out, bag_topics) if t.endswith(kinds)]
    if not images:
        raise ValueError(f"the bag has no {'image' if decode else 'compressed image'} topic: {bag_topics}")
    wanted = camera_topic if decode else camera_topic.rstrip("/") + "/compressed"
    return (wanted if wanted in images else images[0]), sorted(set(out))


def replay_cmd(bag: Path, ns: str, camera: str, published: list[str], camera_topic: str, hz: float, run_s: float,
               stats: Path, wait_s: float, decode: bool = True) -> list[str]:
    """vla_bag_replay as sweep.py runs it (re-timed, looped, decoded unless ``decode`` is false), each topic
    remapped under ``/<ns>``: the camera onto the topic the edge subscribes for this robot (``/compressed``
    appended when the frames stay compressed)."""
    target = camera_topic if decode else camera_topic.rstrip("/") + "/compressed"
    remaps = [x for t in published for x in ("-r", f"{t}:={robot_topic(ns, target if t == camera else t)}")]
    return [sys.executable, "-m", REPLAY, str(bag), "--camera-hz", f"{hz:g}", *(["--decode"] if decode else []),
            "--loop", "--duration-s", f"{run_s:g}", "--wait-for", camera, "--wait-timeout-s", f"{wait_s:g}",
            "--stats-out", str(stats), "--ros-args", *remaps]


def synthetic_bag(work: Path, size: str) -> tuple[Path, str]:
    """A synthetic clip (RLDS -> bag, as sweep.default_bag without the Bridge sample) of ``size`` = "HxW" frames."""
    from vla_edge_ros.data import oxe_to_bag, rlds

    h, w = (int(x) for x in size.lower().split("x"))
    src = rlds.write_synthetic_dataset(work / "synthetic_rlds", "bridge_dataset", episodes=4, steps=20,
                                       image_hw=(h, w))
    s = oxe_to_bag.convert(src, work / "clip_bag", progress=False, overwrite=True)
    return work / "clip_bag", f"synthetic clip ({s.episodes} episodes, {s.frames} JPEG frames of {w}x{h} at 5 Hz)"


# ---------------------------------------------------------------------------------------------------------------
# figures
# ---------------------------------------------------------------------------------------------------------------

def _say(msg: str) -> None:
    print(f"fleet_replay: {msg}", flush=True)


FAILED_LINE = "autostart did not reach 'active'"  # ros/runtime.py: configure / activate failed, process stays up


def wait_edge(edge: Child, timeout_s: float) -> Optional[str]:
    """procs.wait_active, returning early with the edge's reason when its autostart failed (a failed configure
    leaves the process running, unconfigured: waiting on would only wait out the timeout)."""
    t_end = time.monotonic() + timeout_s
    while True:
        why = wait_active(edge, max(0.1, min(2.0, t_end - time.monotonic())))
        if why is None or not edge.alive():
            return why
        failed = [line for line in edge.output().splitlines() if FAILED_LINE in line]
        if failed:
            return f"edge: {failed[-1].split(']: ', 1)[-1]} (see {edge.log_path})"
        if time.monotonic() >= t_end:
            return f"edge not active after {timeout_s:.0f} s (see {edge.log_path})"


def _stop_all(groups: list[tuple[list[Child], float]]) -> dict[str, int]:
    """Group after group: SIGINT to each of the group, then wait for each (up to the group's timeout, then
    SIGKILL); exit codes by name (-9: killed)."""
    codes: dict[str, int] = {}
    for children, timeout_s in groups:
        for c in children:
            c.interrupt()
        codes.update({c.name: c.stop(timeout_s) for c in children})
    return codes


def run(args: argparse.Namespace) -> int:
    import yaml

    ns = namespaces(args.robots)
    out = Path(args.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="vla_fleet_replay_"))
    if args.bag:
        bag, desc = Path(args.bag), f"given bag {args.bag}"
        if not bag.exists():
            print(f"vla_fleet_replay: bag {bag} does not exist", file=sys.stderr)
            return 2
    elif args.synthetic_size:
        bag, desc = synthetic_bag(work, args.synthetic_size)
    else:
        bag, desc = default_bag(work)
    decode = args.image_transport == "raw"
    from vla_edge_ros.ros.tools.bag_sources import open_bag

    camera_topic = registry.BY_NAME["camera_topic"].default
    try:
        src = open_bag(str(bag))
        bag_topics = list(src.topics)
        src.close()
        camera, published = replay_topics(bag_topics, camera_topic, decode)
    except Exception as exc:  # BagError (unreadable bag) or no image topic: one line, no traceback
        print(f"vla_fleet_replay: cannot replay {bag}: {exc}", file=sys.stderr)
        return 2
    instruction = args.instruction if args.instruction is not None else first_instruction(bag)
    values = edge_values(args, ns)
    reasons = check_values(values, instruction)
    if reasons:
        print(f"vla_fleet_replay: edge parameters rejected: {'; '.join(reasons)}", file=sys.stderr)
        return 2
    params_file = logs / "edge.params.yaml"  # the instruction (spaces) and the camera check: not as -p
    params_file.write_text(yaml.safe_dump({
        "vla_inference": {"ros__parameters": {"instruction": instruction} if instruction else {}},
        # the replay repeats each 5 Hz bag frame at 60 Hz on purpose: the frozen-camera check stays off (sweep.py)
        "vla_camera": {"ros__parameters": {"frozen_frame_limit": 0, "image_transport": args.image_transport}}}))
    env = ros_child_env(args.domain_id, work / "ros_home")
    run_s = args.startup_timeout + args.duration + 180  # a safety net: every child exits by itself after this
    edge_stats, robot_stats = logs / "edge.stats.json", {n: logs / f"robot_{n}.stats.json" for n in ns}
    replay_stats = {n: logs / f"replay_{n}.stats.json" for n in ns}
    for p in (edge_stats, *robot_stats.values(), *replay_stats.values()):
        p.unlink(missing_ok=True)
    _say(f"{len(ns)} robots ({','.join(ns)}), backend {args.backend}, {args.duration:g} s at {args.camera_hz:g} Hz, "
         f"domain {args.domain_id}, bag: {desc}")
    edge = Child(edge_cmd(values, params_file, edge_stats, run_s, args.edge_stats_every_s, args.param), env,
                 logs / "edge.log", name="edge", cwd=REPO)
    robots = [Child(robot_cmd(n, robot_stats[n], run_s, args.stats_every_s), env, logs / f"robot_{n}.log",
                    name=f"robot_{n}", cwd=REPO) for n in ns]
    replays: list[Child] = []
    errors: list[str] = []
    t0 = time.monotonic()
    edge_start: dict = {}
    settle: Optional[dict] = None  # what the edge counted while settling (--settle-s)
    edge_cpu: Optional[dict] = None  # the edge process's CPU time over the window (Linux)
    edge_window_end: dict = {}
    machine: Optional[dict] = None  # the machine's CPU over the window (bench/host_load.py)
    robots_start, robots_end, kv_peak = {}, {}, {}  # ns -> stats at the window's start / end; ns -> KV bytes
    try:
        not_active = wait_edge(edge, args.startup_timeout)
        if not_active:
            raise RuntimeError(not_active)
        _say(f"edge active after {time.monotonic() - t0:.1f} s; starting {len(ns)} camera replays")
        replays = [Child(replay_cmd(bag, n, camera, published, camera_topic, args.camera_hz, run_s,
                                    replay_stats[n], 60.0, decode), env, logs / f"replay_{n}.log",
                         name=f"replay_{n}", cwd=REPO) for n in ns]
        everyone = [edge, *robots, *replays]

        def check_alive() -> None:
            dead = [c for c in everyone if not c.alive()]
            if dead:
                raise RuntimeError("; ".join(f"{c.name} exited with {c.p.returncode} (see {c.log_path})"
                                             for c in dead))

        t_wait = time.monotonic() + 90.0
        while True:  # the window opens once every robot's frames reach the edge
            check_alive()
            st = _read_json(edge_stats) or {}
            waiting = [n for n in ns if not edge_robot(st, n)["frames_received"]]
            if not waiting or time.monotonic() > t_wait:
                break
            time.sleep(0.25)
        if waiting:
            _say(f"WARNING: no frames at the edge from {', '.join(waiting)} after 90 s; measuring anyway")
        if args.settle_s > 0:
            settle_from = next_write(edge_stats, args.edge_stats_every_s + 2.0) or st
            _say(f"frames flowing; settling {args.settle_s:g} s before the window")
            t_settled = time.monotonic() + args.settle_s
            while time.monotonic() < t_settled:
                check_alive()
                time.sleep(0.25)
        edge_start = next_write(edge_stats, args.edge_stats_every_s + 2.0) or st  # the window opens on a write
        if args.settle_s > 0:
            settle = settle_figures(ns, settle_from, edge_start, args.settle_s)
        robots_start = {n: _read_json(robot_stats[n]) or {} for n in ns}
        _say(f"{'settled' if args.settle_s > 0 else 'frames flowing'}; measuring {args.duration:g} s")
        t_start = time.monotonic()
        load_start = host_load.sample(edge.p.pid)  # the machine's CPU, and the edge's own and its children's
        t_end, next_note, last_mtime = t_start + args.duration, t_start + min(10.0, args.duration / 4), 0.0
        while time.monotonic() < t_end:
            time.sleep(0.25)
            check_alive()
            mtime = edge_stats.stat().st_mtime if edge_stats.exists() else 0.0
            if mtime == last_mtime:
                continue
            last_mtime, st = mtime, _read_json(edge_stats) or {}
            for n, b in (_get(st, "inference", "engine_memory", "per_robot_kv_bytes", default={}) or {}).items():
                kv_peak[n] = max(kv_peak.get(n, 0), int(b or 0))
            if time.monotonic() >= next_note:
                next_note += min(10.0, args.duration / 4)
                now = {n: counter_delta(edge_robot(st, n), edge_robot(edge_start, n)) for n in ns}
                _say(f"t={time.monotonic() - t_start:5.1f} s  admitted " + " ".join(
                    f"{n}:{c['admitted']}/{c['deadline_misses']}m" for n, c in now.items()))
        # the window closes on the edge's next write (it opened on one, so its counters cover the window the CPU
        # figures and t_window do), with the robots' stats as last written (at most --stats-every-s old); before
        # anything stops (no shutdown holds or drains)
        edge_window_end = next_write(edge_stats, args.edge_stats_every_s + 2.0) or _read_json(edge_stats) or {}
        load_end, t_window = host_load.sample(edge.p.pid), time.monotonic() - t_start
        machine = host_load.window(load_start, load_end, t_window)
        robots_end = {n: _read_json(robot_stats[n]) for n in ns}
        p0, p1 = load_start.get("process") or {}, load_end.get("process") or {}
        if "cpu_s" in p0 and "cpu_s" in p1:
            edge_cpu = {"cpu_s": p1["cpu_s"] - p0["cpu_s"], "window_s": t_window}
            if "children_cpu_s" in p0 and "children_cpu_s" in p1:
                edge_cpu["children_cpu_s"] = p1["children_cpu_s"] - p0["children_cpu_s"]
    except RuntimeError as exc:
        errors.append(str(exc))
    except KeyboardInterrupt:
        errors.append("interrupted")
    finally:
        # cameras first: the edge's final frames received then compare with what the replays published; the
        # robots last (the window's figures are already read)
        _say("stopping (SIGINT: replays, then the edge, then the robots)")
        codes = _stop_all([(replays, 15.0), ([edge], 60.0), (robots, 15.0)])
    edge_end = _read_json(edge_stats)
    if edge_end is None:
        errors.append(f"the edge wrote no stats (exit code {codes.get('edge')}; see {edge.log_path})")
    errors += [f"robot {n} wrote no stats (see {logs / f'robot_{n}.log'})" for n in ns
               if not errors and robots_end.get(n) is None]
    errors += [f"{name} did not exit cleanly on SIGINT (exit code {c}; see {logs / (name + '.log')})"
               for name, c in codes.items() if c != 0 and not name.startswith("replay_") and not errors]
    result = summarise(ns, edge_start, edge_window_end or edge_end or {}, robots_start,
                       {n: v or {} for n, v in robots_end.items()}, {n: _read_json(p) for n, p in replay_stats.items()},
                       kv_peak, edge_final=edge_end, edge_cpu=edge_cpu)
    result["edge"]["machine_cpu"] = machine
    result["settle"] = settle
    result["meta"] = {"robots": len(ns), "duration_s": args.duration, "settle_s": args.settle_s,
                      "camera_hz": args.camera_hz,
                      "image_transport": args.image_transport,
                      "bag": str(bag), "bag_description": desc, "instruction": instruction,
                      "edge_values": values, "extra_params": args.param, "domain_id": args.domain_id,
                      "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, Python "
                                 f"{platform.python_version()}", "exit_codes": codes, "errors": errors,
                      "command": getattr(args, "command", "")}
    (out / "fleet_replay.json").write_text(json.dumps(result, indent=2, default=str))
    if edge_start:  # the window was measured (else the table would be all zeros)
        text = table(result)
        (out / "fleet_replay.md").write_text(text)
        print(text, flush=True)
    _say(f"written {out / 'fleet_replay.json'}{' and the table' if edge_start else ''}; logs in {logs}")
    if errors:
        print("vla_fleet_replay: the run FAILED: " + " | ".join(errors), file=sys.stderr)
        return 1
    return 0


def main(argv: Optional[Iterable[str]] = None) -> int:
    argv = list(argv) if argv is not None else sys.argv[1:]
    args = parse_args(argv)
    args.command = "python -m vla_edge_ros.bench.fleet_replay " + " ".join(argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
