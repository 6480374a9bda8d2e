"""`vla_sim_demos`: scripted-expert demonstrations of the simulated tasks, recorded as one rosbag2 bag.

    vla_sim_demos OUT_BAG [--tasks reach push ...] [--episodes N] [--seed-start S] [--workers W]
                  [--width 128 --height 64] [--camera corner] [--control-hz 10] [--keep-failed]

Why: behaviour cloning (train/) reads bags, and a demonstration must look exactly like what the runtime sees
and commands in the closed loop. So each episode is the benchmark's own scripted expert (sim/expert.py) driven
through the same 7-dim -> 4-dim mapping and episode controller as a received action; frame i is the camera image
the sim node (ros/sim_node.py) would publish before step i (same MetaWorldSim.render: camera, size, shadows off),
and action i is the 7-dim action in the runtime's naming and units (x y z metres, roll pitch yaw 0, gripper
1 = open) that the expert commanded from that state. The bag is written by data/bag_writer.py in the OXE
converter's topic layout, stamped at the sim's control rate (``--control-hz``, the vla_sim parameter's default):

    /camera/image_raw        sensor_msgs/Image rgb8, frame_id sim_camera (--images png: /compressed as PNG)
    /vla/instruction         the task's instruction (sim/tasks.py), at each episode start
    /vla/recorded_action     JointState x y z roll pitch yaw gripper
    /vla/episode_events      episode_start {task, seed, rate_hz, camera, width, height, horizon, ...} and
                             episode_end {success, end, seed, task, steps, saturated}; gripper_open / _close

Image size: 128 x 64 (width x height) by default, what the runtime's patch embedder takes without resampling
(engine/config.py patch_grid [4, 8] x patch_size 16 = 64 x 128); run vla_sim with the same image_width /
image_height (and camera) as the demonstrations, or the policy sees another picture than it learned from.

Seeds: task t's episodes start from seeds seed_start .. seed_start + N - 1 (a seed fixes the initial state; see
metaworld_env.py). The default seed_start (1 000 000) keeps demonstrations apart from the sim node's default
seeds (0, 1, ...), which the evaluation uses as held-out initial states. Only successful expert episodes are
written unless ``--keep-failed``; failures are counted and listed by seed.

Rendering dominates (~37 ms per 96 x 96 frame on the 2-core CPU machine), so ``--workers`` processes (spawned,
one env and one GL context each) render episodes in parallel; the bag is written by the main process in job
order, so it does not depend on the number of workers. The summary reports demos/s and frames/s.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from vla_edge_ros.data.bag_writer import (DEFAULT_START_NS, STORAGES, TOPIC_IMAGE, BagWriter, episode_stamps,
                                          next_episode_start, prepare_output, write_episode)
from vla_edge_ros.sim.tasks import CAMERAS, DEFAULT_CAMERA, TASK_KEYS, task_spec

DEFAULT_SEED_START = 1_000_000
DEFAULT_WIDTH, DEFAULT_HEIGHT = 128, 64  # the default patch embedder's 64 x 128, unresampled
DEFAULT_CONTROL_HZ = 10.0  # vla_sim's control_hz default (vla_edge_ros/params.py)
DEFAULT_HORIZON = 200  # vla_sim's horizon default
IMAGE_MODES = ("raw", "png", "both")
FRAME_ID = "sim_camera"  # the sim node's image frame_id


@dataclass(frozen=True)
class DemoSpec:
    """What one worker needs to record an episode (picklable)."""
    camera: str = DEFAULT_CAMERA
    width: int = DEFAULT_WIDTH
    height: int = DEFAULT_HEIGHT
    horizon: int = DEFAULT_HORIZON


@dataclass
class Demo:
    task: str
    seed: int
    frames: np.ndarray  # (T, H, W, 3) uint8, the image before each step
    actions: np.ndarray  # (T, 7) float64, the commanded action of each step
    result: dict[str, Any]  # sim/episode.EpisodeResult as a dict
    record_s: float


@dataclass
class DemoSummary:
    bag: str
    tasks: list[str]
    workers: int
    attempted: int = 0
    kept: int = 0
    failed_seeds: dict[str, list[int]] = field(default_factory=dict)  # task -> seeds whose expert failed
    frames: int = 0
    elapsed_s: float = 0.0
    render_s: float = 0.0  # summed over workers
    bag_bytes: int = 0
    messages: dict[str, int] = field(default_factory=dict)

    @property
    def demos_per_s(self) -> float:
        return self.attempted / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "demos_per_s": round(self.demos_per_s, 3),
                "frames_per_s": round(self.frames / self.elapsed_s, 1) if self.elapsed_s > 0 else 0.0}

    def text(self) -> str:
        failed = sum(len(v) for v in self.failed_seeds.values())
        lines = [f"vla_sim_demos: {', '.join(self.tasks)} -> {self.bag}",
                 f"  episodes  {self.attempted} recorded, {self.kept} kept, {failed} expert failures"
                 + (f" (seeds {json.dumps(self.failed_seeds)})" if failed else ""),
                 f"  frames    {self.frames} kept",
                 f"  time      {self.elapsed_s:.1f} s with {self.workers} worker(s): {self.demos_per_s:.2f} demos/s, "
                 f"{self.to_dict()['frames_per_s']} frames/s kept",
                 f"  bag       {self.bag_bytes} bytes"]
        lines += [f"  {t:<34} {n} messages" for t, n in sorted(self.messages.items())]
        return "\n".join(lines)


# ---- workers ------------------------------------------------------------------------------------------------
_SIMS: dict[tuple, Any] = {}  # one MetaWorldSim per (task, spec) in each worker process


def _sim_for(task: str, spec: DemoSpec):
    key = (task, spec)
    if key not in _SIMS:
        import vla_edge_ros.sim  # noqa: F401  MUJOCO_GL before mujoco
        from vla_edge_ros.sim.metaworld_env import MetaWorldSim

        _SIMS[key] = MetaWorldSim(task, spec.camera, spec.width, spec.height, spec.horizon)
    return _SIMS[key]


def record_demo(task: str, seed: int, spec: DemoSpec = DemoSpec()) -> Demo:
    """One expert episode from ``seed``: the image before every step and the 7-dim action taken from it."""
    from vla_edge_ros.sim.expert import run_expert_episode

    sim = _sim_for(task, spec)
    frames, actions = [], []
    t0 = time.perf_counter()

    def on_step(s, a7: np.ndarray) -> None:
        frames.append(s.render())
        actions.append(np.asarray(a7, dtype=np.float64))

    result = run_expert_episode(sim, int(seed), on_step=on_step)
    return Demo(task, int(seed), np.stack(frames), np.stack(actions), asdict(result), time.perf_counter() - t0)


def _record_job(job: tuple[str, int, DemoSpec]) -> Demo:
    return record_demo(*job)


def _close_sims() -> None:
    for s in _SIMS.values():
        s.close()
    _SIMS.clear()


# ---- the bag ------------------------------------------------------------------------------------------------
def _png(rgb: np.ndarray) -> bytes:
    import io

    from PIL import Image as PILImage

    buf = io.BytesIO()
    PILImage.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


def _write_demo(bag: BagWriter, index: int, demo: Demo, spec: DemoSpec, control_hz: float, images: str,
                start_ns: int) -> list[int]:
    instruction = task_spec(demo.task).instruction
    stamps = episode_stamps(start_ns, len(demo.actions), control_hz)
    r = demo.result

    def write_images(i: int, stamp: int) -> None:
        if images in ("raw", "both"):
            bag.raw_image(TOPIC_IMAGE, demo.frames[i], stamp, FRAME_ID)
        if images in ("png", "both"):
            bag.compressed_image(TOPIC_IMAGE, _png(demo.frames[i]), "png", stamp, FRAME_ID)

    write_episode(bag, index, demo.actions, [instruction] * len(stamps), stamps, write_images,
                  start_fields={"task": demo.task, "seed": demo.seed, "rate_hz": control_hz, "camera": spec.camera,
                                "width": spec.width, "height": spec.height, "horizon": spec.horizon,
                                "source": f"metaworld:{task_spec(demo.task).env_name}", "expert": "metaworld.policies"},
                  end_fields={"task": demo.task, "seed": demo.seed, "success": bool(r["success"]), "end": r["end"],
                              "saturated": int(r["saturated"])})
    return stamps


def record_demos(out_bag: str | Path, tasks: Sequence[str], episodes: int, seed_start: int = DEFAULT_SEED_START,
                 spec: DemoSpec = DemoSpec(), workers: int = 1, control_hz: float = DEFAULT_CONTROL_HZ,
                 keep_failed: bool = False, images: str = "raw", storage: str = "mcap", overwrite: bool = False,
                 progress: bool = True, episode_gap_s: float = 1.0, start_ns: int = DEFAULT_START_NS) -> DemoSummary:
    """Record ``episodes`` expert episodes per task (seeds seed_start ..) into one bag; see the module docstring."""
    for t in tasks:
        task_spec(t)  # unknown task: ValueError naming the choices
    if episodes < 1 or workers < 1:
        raise ValueError(f"episodes and workers must be >= 1, got {episodes} and {workers}")
    if images not in IMAGE_MODES:
        raise ValueError(f"images must be one of {', '.join(IMAGE_MODES)}, got {images!r}")
    if spec.camera not in CAMERAS:
        raise ValueError(f"unknown camera {spec.camera!r}; one of: {', '.join(CAMERAS)}")
    out = prepare_output(out_bag, overwrite)
    jobs = [(t, seed_start + k, spec) for t in tasks for k in range(episodes)]
    summary = DemoSummary(str(out), list(tasks), workers)
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    bar = tqdm(total=len(jobs), unit="ep", desc="vla_sim_demos", disable=None if progress else True,
               file=sys.stderr) if tqdm else None
    t0 = time.perf_counter()
    pool = None
    try:
        if workers > 1:
            # spawn: a fresh interpreter per worker, so no GL context, OpenBLAS thread pool or lock is inherited
            pool = multiprocessing.get_context("spawn").Pool(min(workers, len(jobs)))
            results = pool.imap(_record_job, jobs)
        else:
            results = map(_record_job, jobs)
        ep_start = start_ns
        with BagWriter(out, storage) as bag:
            for demo in results:
                summary.attempted += 1
                summary.render_s += demo.record_s
                if demo.result["success"] or keep_failed:
                    stamps = _write_demo(bag, summary.kept, demo, spec, control_hz, images, ep_start)
                    ep_start = next_episode_start(stamps, control_hz, episode_gap_s)
                    summary.kept += 1
                    summary.frames += len(stamps)
                if not demo.result["success"]:
                    summary.failed_seeds.setdefault(demo.task, []).append(demo.seed)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(kept=summary.kept, failed=sum(map(len, summary.failed_seeds.values())),
                                    refresh=False)
            summary.messages = dict(bag.counts)
        summary.bag_bytes = bag.bytes_written()
    finally:
        if pool is not None:
            pool.close()
            pool.join()
        if workers <= 1:
            _close_sims()
        if bar is not None:
            bar.close()
    summary.elapsed_s = time.perf_counter() - t0
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vla_sim_demos", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_bag", help="output bag directory (must not exist unless --overwrite)")
    p.add_argument("--tasks", nargs="+", default=["reach"], choices=TASK_KEYS)
    p.add_argument("--episodes", type=int, default=50, help="episodes (seeds) per task")
    p.add_argument("--seed-start", type=int, default=DEFAULT_SEED_START)
    p.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1), help="render processes")
    p.add_argument("--width", type=int, default=DEFAULT_WIDTH, help="image width (vla_sim image_width)")
    p.add_argument("--height", type=int, default=DEFAULT_HEIGHT, help="image height (vla_sim image_height)")
    p.add_argument("--camera", default=DEFAULT_CAMERA, choices=CAMERAS)
    p.add_argument("--horizon", type=int, default=DEFAULT_HORIZON, help="control steps before an episode fails")
    p.add_argument("--control-hz", type=float, default=DEFAULT_CONTROL_HZ, help="stamp spacing (vla_sim control_hz)")
    p.add_argument("--keep-failed", action="store_true", help="also write episodes the expert did not solve")
    p.add_argument("--images", choices=IMAGE_MODES, default="raw", help="raw rgb8 (what vla_sim publishes), png "
                                                                        "(CompressedImage, ~3x smaller) or both")
    p.add_argument("--storage", choices=STORAGES, default="mcap")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--summary-json", help="also write the summary as JSON here")
    p.add_argument("--overwrite", action="store_true")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        summary = record_demos(a.out_bag, a.tasks, a.episodes, a.seed_start,
                               DemoSpec(a.camera, a.width, a.height, a.horizon), a.workers, a.control_hz,
                               a.keep_failed, a.images, a.storage, a.overwrite, not a.no_progress)
    except (ValueError, FileExistsError) as exc:
        print(f"vla_sim_demos: error: {exc}", file=sys.stderr)
        return 2
    print(summary.text())
    if a.summary_json:
        Path(a.summary_json).write_text(json.dumps(summary.to_dict(), indent=2))
    if summary.kept == 0:
        print("vla_sim_demos: error: no episode kept", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
