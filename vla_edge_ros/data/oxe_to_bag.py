"""Convert an Open X-Embodiment RLDS dataset directory into a standard ROS 2 bag (rosbags, no ROS install needed).

    oxe_to_bag RLDS_DIR OUT_BAG [--dataset NAME[:VERSION]] [--episodes N] [--storage mcap|sqlite3]

Topics (Jazzy message definitions, CDR, rosbag2 metadata version 9 as Jazzy's recorder writes it, so
`ros2 bag play` accepts the bag):

    /camera/image_raw/compressed  sensor_msgs/CompressedImage  encoded frames kept as they are (jpeg/png)
    /camera/image_raw             sensor_msgs/Image (rgb8)      raw sources, or --images raw|both
    /camera<i>/image_raw[...]     the same for the mapping's extra image keys (i = 1, 2, ...)
    /vla/instruction              std_msgs/String               at each episode start and whenever it changes
    /vla/recorded_action          sensor_msgs/JointState        name = x y z roll pitch yaw gripper (the runtime's
                                                                names, mappings.ACTION_NAMES), position = the values
    /vla/episode_events           std_msgs/String (JSON)        episode_start, episode_end, gripper_open/close

Every message of step i of an episode is stamped (header and bag time) at episode_start + i / rate_hz, the
dataset's native control rate; episodes follow each other with a gap (--episode-gap, default 1 s).
Damaged records are skipped and listed in the summary; nothing is dropped silently. The bag is written by
data/bag_writer.py, the writer sim/demos.py uses too (one topic layout for OXE and simulated demonstrations).

metadata.yaml says ``ros_distro: jazzy`` (rosbags' Writer writes "rosbags"; it is rewritten, in metadata.yaml and
in the copy the storage file embeds) and gives each topic the QoS its publisher offers, in full (history, depth,
reliability, durability, deadline, lifespan, liveliness and its lease, avoid_ros_namespace_conventions), because
`ros2 bag play` offers the recorded profile and falls back to reliable + volatile for a topic without one:
camera topics best effort, keep last 1, volatile (sensor data; no deadline, since the bag plays at the dataset's
own rate), /vla/instruction reliable + transient local (a late subscriber still gets the task), the other topics
reliable, volatile -- the profiles vla_bag_replay offers (ros/qos.py), but for its re-timed camera's deadline.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from .mappings import DatasetMapping, MappingError, custom_mapping, mapping_for, GRIPPER_TRANSFORMS
from .rlds import Episode, RLDSDataset, RLDSError
from .tfrecord import RecordIssue

# the one writer and topic layout (data/bag_writer.py); re-exported here, where they were first defined
from .bag_writer import (BAG_VERSION, CAMERA_QOS, COMPRESSED_SUFFIX, DEFAULT_START_NS, GRIPPER_THRESHOLD,  # noqa: F401
                         INFINITE_S_NS, INSTRUCTION_QOS, RELIABLE_QOS, ROS_DISTRO, STORAGES, TOPIC_ACTION,
                         TOPIC_EVENTS, TOPIC_IMAGE, TOPIC_INSTRUCTION, BagWriter, OfferedQos, episode_stamps,
                         image_topic, next_episode_start, offered_qos, prepare_output, write_episode)

IMAGE_MODES = ("compressed", "raw", "both")


@dataclass
class ConversionSummary:
    dataset: str
    mapping: str
    bag: str
    storage: str
    episodes: int = 0
    frames: int = 0  # camera steps (one per step, whatever the number of image keys)
    messages: dict[str, int] = field(default_factory=dict)
    bag_bytes: int = 0
    duration_s: float = 0.0  # bag time span
    elapsed_s: float = 0.0
    issues: list[RecordIssue] = field(default_factory=list)

    @property
    def skipped(self) -> int:
        return sum(1 for i in self.issues if i.kind != "missing_shard")

    def to_dict(self) -> dict:
        return {"dataset": self.dataset, "mapping": self.mapping, "bag": self.bag, "storage": self.storage,
                "episodes": self.episodes, "frames": self.frames, "messages": dict(self.messages),
                "bag_bytes": self.bag_bytes, "duration_s": round(self.duration_s, 6),
                "elapsed_s": round(self.elapsed_s, 3), "skipped_records": self.skipped,
                "issues": [{"file": i.path, "offset": i.offset, "kind": i.kind, "message": i.message}
                           for i in self.issues]}

    def text(self) -> str:
        lines = [f"oxe_to_bag: {self.dataset} -> {self.bag} ({self.storage})",
                 f"  mapping   {self.mapping}",
                 f"  episodes  {self.episodes}",
                 f"  frames    {self.frames}",
                 f"  bag       {self.bag_bytes} bytes, {self.duration_s:.2f} s of bag time, "
                 f"written in {self.elapsed_s:.2f} s"]
        for topic, n in sorted(self.messages.items()):
            lines.append(f"  {topic:<34} {n} messages")
        lines.append(f"  skipped records: {self.skipped}")
        for issue in self.issues:
            lines.append(f"    {issue}")
        return "\n".join(lines)


def _image_format(data: bytes, declared: str) -> str:
    if data[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    return declared


def decode_image(data: bytes) -> np.ndarray:
    """Encoded JPEG/PNG bytes -> (H, W, 3) uint8 RGB."""
    from PIL import Image as PILImage

    with PILImage.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"), dtype=np.uint8)


def resolve_mapping(ds: RLDSDataset, dataset: str | None = None, image_keys: Sequence[str] = (),
                    instruction_key: str | None = None, action_keys: str | None = None,
                    rate_hz: float | None = None, gripper: str | None = None) -> DatasetMapping:
    """Table mapping for the dataset (``dataset`` "NAME[:VERSION]" overrides dataset_info.json), with any
    command-line fields on top; an unknown dataset needs --image-key, --action-keys and --rate-hz."""
    name, version = ds.name, ds.version
    if dataset:
        name, _, ver = dataset.partition(":")
        version = ver or version
    try:
        base: DatasetMapping | None = mapping_for(name, version, ds.step_keys)
        base_error = None
    except MappingError as exc:
        base, base_error = None, exc
    overrides = bool(image_keys or instruction_key or action_keys or rate_hz or gripper)
    if base is None and not overrides:
        raise base_error  # type: ignore[misc]
    if base is None:
        missing = [flag for flag, v in (("--image-key", image_keys), ("--action-keys", action_keys),
                                        ("--rate-hz", rate_hz)) if not v]
        if missing:
            raise MappingError(f"{base_error}\nFor a dataset without a table entry give {', '.join(missing)} too")
    mapping = custom_mapping(
        name, version,
        list(image_keys) if image_keys else list(base.image_keys),  # type: ignore[union-attr]
        instruction_key if instruction_key is not None else (base.instruction_key if base else None),
        action_keys if action_keys else [str(p) for p in base.action_parts],  # type: ignore[union-attr]
        rate_hz if rate_hz else base.rate_hz,  # type: ignore[union-attr]
        gripper or (base.gripper if base else "open01")) if overrides else base
    missing = mapping.missing_keys(ds.step_keys)  # type: ignore[union-attr]
    if missing:
        raise MappingError(f"mapping for {name} {version} names step keys the dataset does not have: "
                           f"{', '.join(missing)}; available: {', '.join(ds.step_keys)}")
    return mapping  # type: ignore[return-value]


def _expected_episodes(ds: RLDSDataset, split: str | None) -> int | None:
    entry = ds.splits.get(split or ds.default_split() or "")
    try:
        return sum(int(x) for x in entry["shardLengths"]) if entry else None
    except (KeyError, TypeError, ValueError):
        return None


def convert(rlds_dir: str | os.PathLike, out_bag: str | os.PathLike, dataset: str | None = None,
            episodes: int | None = None, storage: str = "mcap", mapping: DatasetMapping | None = None,
            images: str = "compressed", split: str | None = None, start_ns: int = DEFAULT_START_NS,
            episode_gap_s: float = 1.0, progress: bool = True, overwrite: bool = False) -> ConversionSummary:
    if storage not in STORAGES:
        raise ValueError(f"storage must be one of {', '.join(STORAGES)}, got {storage!r}")
    if images not in IMAGE_MODES:
        raise ValueError(f"images must be one of {', '.join(IMAGE_MODES)}, got {images!r}")
    ds = RLDSDataset(rlds_dir)
    mapping = mapping or resolve_mapping(ds, dataset)
    out = prepare_output(out_bag, overwrite)
    summary = ConversionSummary(f"{ds.name} {ds.version}", mapping.describe(), str(out), storage)
    t0 = time.perf_counter()
    total = _expected_episodes(ds, split)
    if episodes is not None:
        total = min(total, episodes) if total is not None else episodes
    try:
        from tqdm import tqdm
    except ImportError:  # progress bar is optional
        tqdm = None
    bar = tqdm(total=total, unit="ep", desc="oxe_to_bag", disable=None if progress else True,
               file=sys.stderr) if tqdm else None
    ep_start = start_ns
    first_stamp = last_stamp = None
    with BagWriter(out, storage) as bag:
        for ep in ds.episodes(split=split, limit=episodes, issues=summary.issues):
            if ep.num_steps == 0:
                summary.issues.append(RecordIssue(ep.shard, ep.offset, "empty", "episode has no steps; skipped"))
                continue
            action = mapping.action(ep.steps)  # MappingError propagates: a wrong mapping is wrong for all
            instructions = mapping.instructions(ep.steps, ep.num_steps)
            stamps = episode_stamps(ep_start, ep.num_steps, mapping.rate_hz)
            _write_episode(bag, ds, mapping, ep, action, instructions, stamps, images)
            summary.episodes += 1
            summary.frames += ep.num_steps
            first_stamp = stamps[0] if first_stamp is None else first_stamp
            last_stamp = stamps[-1]
            ep_start = next_episode_start(stamps, mapping.rate_hz, episode_gap_s)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(frames=summary.frames, skipped=summary.skipped, refresh=False)
        summary.messages = dict(bag.counts)
    if bar is not None:
        bar.close()
    summary.elapsed_s = time.perf_counter() - t0
    summary.bag_bytes = bag.bytes_written()
    if first_stamp is not None:
        summary.duration_s = (last_stamp - first_stamp) / 1e9
    return summary


def _write_episode(bag: BagWriter, ds: RLDSDataset, mapping: DatasetMapping, ep: Episode, action: np.ndarray,
                   instructions: list[str], stamps: list[int], images: str) -> None:
    frames = []
    for k, key in enumerate(mapping.image_keys):
        spec = ds.step_specs[key]
        frames.append((image_topic(k), spec, ep.steps[key]))

    def write_images(i: int, stamp: int) -> None:
        for topic, spec, values in frames:
            frame_id = "camera" if topic == TOPIC_IMAGE else topic.strip("/").split("/")[0]
            if spec.kind == "image":
                data = bytes(values[i])
                if images in ("compressed", "both"):
                    bag.compressed_image(topic, data, _image_format(data, spec.encoding), stamp, frame_id)
                if images in ("raw", "both"):
                    _write_raw(bag, topic, decode_image(data), stamp, frame_id)
            else:  # a raw uint8 tensor image (H, W, 3): only sensor_msgs/Image makes sense
                _write_raw(bag, topic, np.asarray(values[i]), stamp, frame_id)

    write_episode(bag, ep.index, action, instructions, stamps, write_images,
                  start_fields={"source": f"{os.path.basename(ep.shard)}@{ep.offset}", "rate_hz": mapping.rate_hz})


def _write_raw(bag: BagWriter, topic: str, rgb: np.ndarray, stamp: int, frame_id: str) -> None:
    try:
        bag.raw_image(topic, np.asarray(rgb).astype(np.uint8, copy=False), stamp, frame_id)
    except ValueError as exc:
        raise RLDSError(str(exc)) from exc


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="oxe_to_bag", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rlds_dir", help="RLDS dataset directory (dataset_info.json + features.json + shards), "
                                    "or a folder with exactly one below it")
    p.add_argument("out_bag", help="output bag directory (must not exist unless --overwrite)")
    p.add_argument("--dataset", help="mapping table entry NAME[:VERSION] (default: from dataset_info.json)")
    p.add_argument("--episodes", type=int, help="convert at most N episodes")
    p.add_argument("--storage", choices=STORAGES, default="mcap")
    p.add_argument("--split", help="split to read (default: train, else the first)")
    p.add_argument("--images", choices=IMAGE_MODES, default="compressed",
                   help="compressed: keep JPEG/PNG as CompressedImage; raw: decode to sensor_msgs/Image rgb8; both")
    g = p.add_argument_group("mapping overrides (required for datasets not in the table)")
    g.add_argument("--image-key", action="append", default=[], help="step key of a camera image (repeatable; "
                                                                   "first = /camera/image_raw)")
    g.add_argument("--instruction-key", help="step key of the language instruction")
    g.add_argument("--action-keys", help="comma-separated step keys (KEY or KEY[a:b]) concatenated to 7 dims")
    g.add_argument("--rate-hz", type=float, help="native control rate")
    g.add_argument("--gripper", choices=sorted(GRIPPER_TRANSFORMS), help="convention of the last action dim")
    p.add_argument("--start-time", type=float, default=DEFAULT_START_NS / 1e9, help="bag time of the first frame (s)")
    p.add_argument("--episode-gap", type=float, default=1.0, help="seconds between episodes")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--summary-json", help="also write the summary as JSON here")
    p.add_argument("--overwrite", action="store_true", help="replace OUT_BAG if it exists")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.episodes is not None and args.episodes < 1:
        print("oxe_to_bag: --episodes must be >= 1", file=sys.stderr)
        return 2
    try:
        ds = RLDSDataset(args.rlds_dir)
        mapping = resolve_mapping(ds, args.dataset, args.image_key, args.instruction_key, args.action_keys,
                                  args.rate_hz, args.gripper)
        summary = convert(ds.root, args.out_bag, episodes=args.episodes, storage=args.storage, mapping=mapping,
                          images=args.images, split=args.split, start_ns=int(round(args.start_time * 1e9)),
                          episode_gap_s=args.episode_gap, progress=not args.no_progress, overwrite=args.overwrite)
    except (RLDSError, MappingError, FileExistsError, ValueError) as exc:
        print(f"oxe_to_bag: error: {exc}", file=sys.stderr)
        return 2
    print(summary.text())
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(summary.to_dict(), indent=2))
    if summary.episodes == 0:
        print("oxe_to_bag: error: no episode converted", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
