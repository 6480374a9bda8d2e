"""The frames bench/quant_report.py measures every weight_dtype on: noise, the real Bridge clip, or MetaWorld.

Why: agreement with the bf16 model on random noise says little about a trained policy. Its inputs are camera
frames of one scene in order, streamed through a KV window (each chunk attends to the previous frames' K/V), and
conditioned on the instruction of its task. So a source yields ``FrameSequence``s, each the consecutive frames of
ONE episode with that episode's instruction, and quant_report streams every sequence through a fresh KV manager
(as the runtime starts an episode with an empty cache).

- random: uint8 noise (120 x 160), fixed by the seed, the default instruction; one sequence (the seed behaviour);
- bridge: the real BridgeData RLDS sample (../shared/data/oxe, read-only; data/rlds.py reads it and the mapping
  table of data/mappings.py names its camera and instruction keys): the first N episodes, each its own sequence
  of the first camera's frames (64 x 64 JPEG; the patch embedder resamples them to the model's image size) and
  its language instruction, the default instruction where an episode has none;
- sim: MetaWorld (the optional ``sim`` extra, imported only when asked for) rendered at the model's image size
  along the scripted expert's rollout of a task (sim/expert.py) from seeds s .. s + N - 1, every k-th control
  step, with the task's instruction (sim/tasks.py). Seeds 0, 1, ... are the evaluation's held-out initial states
  (sim/demos.py records its demonstrations from seed 1 000 000 on).
"""
from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

DEFAULT_INSTRUCTION = "pick up the object"
FRAME_SOURCES = ("random", "bridge", "sim")
SHARED_OXE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "oxe"  # ../shared of the checkout


@dataclass
class FrameSequence:
    """Consecutive frames of one episode, streamed as one run of chunks."""
    name: str  # e.g. "push seed 1", "bridge episode 3"
    instruction: str
    frames: list[np.ndarray]  # (H, W, 3) uint8, in time order
    meta: dict = field(default_factory=dict)  # where the frames come from (seed, episode, expert result, ...)

    def describe(self) -> dict:
        shape = list(self.frames[0].shape) if self.frames else []
        return {"name": self.name, "instruction": self.instruction, "frames": len(self.frames),
                "frame_shape": shape, **self.meta}


def sample_frames(n: int, seed: int = 0) -> list[np.ndarray]:
    """Camera-like uint8 images, fixed by the seed."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (120, 160, 3), dtype=np.uint8) for _ in range(n)]


def random_sequences(frames: int, seed: int = 0, instruction: str = DEFAULT_INSTRUCTION) -> list[FrameSequence]:
    if frames < 1:
        raise ValueError(f"frames must be >= 1, got {frames}")
    return [FrameSequence(f"random seed {seed}", instruction, sample_frames(frames, seed), {"seed": int(seed)})]


def _decode_image(data: bytes) -> np.ndarray:
    """JPEG / PNG bytes -> (H, W, 3) uint8 RGB (as data/oxe_to_bag.decode_image; not imported from there so
    that this tool does not pull in the bag writer)."""
    from PIL import Image as PILImage

    with PILImage.open(io.BytesIO(bytes(data))) as im:
        return np.asarray(im.convert("RGB"), dtype=np.uint8)


def bridge_sequences(root: str | Path = SHARED_OXE, episodes: int = 1, max_frames: Optional[int] = None,
                     default_instruction: str = DEFAULT_INSTRUCTION) -> list[FrameSequence]:
    """The first ``episodes`` episodes of the RLDS dataset under ``root``, at most ``max_frames`` frames each."""
    from vla_edge_ros.data import mappings, rlds

    if episodes < 1 or (max_frames is not None and max_frames < 1):
        raise ValueError(f"episodes and max_frames must be >= 1, got {episodes} and {max_frames}")
    if not Path(root).exists():
        raise FileNotFoundError(f"no RLDS dataset at {root} (the Bridge sample lives in ../shared/data/oxe)")
    ds = rlds.RLDSDataset(root)
    mapping = mappings.mapping_for(ds.name, ds.version, ds.step_keys)
    image_key = mapping.image_keys[0]
    issues: list = []
    out = []
    for ep in ds.episodes(limit=episodes, issues=issues):
        n = ep.num_steps if max_frames is None else min(ep.num_steps, max_frames)
        frames = [_decode_image(b) for b in ep.steps[image_key][:n]]
        said = mapping.instructions(ep.steps, ep.num_steps)[0].strip()
        out.append(FrameSequence(f"bridge episode {ep.index}", said or default_instruction, frames,
                                 {"episode": ep.index, "episode_steps": ep.num_steps, "image_key": image_key,
                                  "instruction_from": "episode" if said else "default",
                                  "dataset": f"{ds.name} {ds.version}"}))
    if len(out) < episodes:
        raise ValueError(f"{ds.root}: asked for {episodes} episodes, {len(out)} readable"
                         + (f" ({len(issues)} damaged records skipped: {issues[0]})" if issues else ""))
    for s in out:
        s.meta["damaged_records_skipped"] = len(issues)  # counted, not silent (none in the shared sample)
    return out


def sim_sequences(task: str, seeds: int, seed_start: int = 0, every: int = 1, max_frames: Optional[int] = None,
                  image_hw: tuple[int, int] = (64, 128), camera: Optional[str] = None) -> list[FrameSequence]:
    """Per seed: the frames the camera sees before every ``every``-th step of the scripted expert's episode (at
    most ``max_frames``), (height, width) = ``image_hw``. Raises ImportError without metaworld, RuntimeError
    without an offscreen GL context (MUJOCO_GL=egl by default)."""
    if seeds < 1 or every < 1 or (max_frames is not None and max_frames < 1):
        raise ValueError(f"seeds, every and max_frames must be >= 1, got {seeds}, {every} and {max_frames}")
    import vla_edge_ros.sim  # noqa: F401  first: it sets MUJOCO_GL=egl before mujoco is imported
    from vla_edge_ros.sim.expert import run_expert_episode
    from vla_edge_ros.sim.metaworld_env import MetaWorldSim
    from vla_edge_ros.sim.tasks import DEFAULT_CAMERA

    height, width = int(image_hw[0]), int(image_hw[1])
    sim = MetaWorldSim(task, camera or DEFAULT_CAMERA, width=width, height=height)
    out = []
    try:
        for seed in range(int(seed_start), int(seed_start) + int(seeds)):
            frames: list[np.ndarray] = []

            def on_step(s, _action7, frames=frames) -> None:  # the state before the step, as the sim node shows it
                if s.steps % every == 0 and (max_frames is None or len(frames) < max_frames):
                    frames.append(s.render())

            result = run_expert_episode(sim, seed, on_step=on_step)
            out.append(FrameSequence(f"{task} seed {seed}", sim.instruction, frames,
                                     {"task": task, "seed": seed, "every": every, "camera": sim.camera,
                                      "expert_steps": result.steps, "expert_success": bool(result.success)}))
    finally:
        sim.close()
    return out
