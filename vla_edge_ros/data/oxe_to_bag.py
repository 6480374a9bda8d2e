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
Damaged records are skipped and listed in the summary; nothing is dropped silently.

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
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from .mappings import ACTION_NAMES, DatasetMapping, MappingError, custom_mapping, mapping_for, GRIPPER_TRANSFORMS
from .rlds import Episode, RLDSDataset, RLDSError
from .tfrecord import RecordIssue

TOPIC_IMAGE = "/camera/image_raw"
TOPIC_INSTRUCTION = "/vla/instruction"
TOPIC_ACTION = "/vla/recorded_action"
TOPIC_EVENTS = "/vla/episode_events"
COMPRESSED_SUFFIX = "/compressed"
DEFAULT_START_NS = 1_700_000_000 * 1_000_000_000  # fixed epoch so conversions are reproducible
GRIPPER_THRESHOLD = 0.5  # gripper (1 open / 0 closed) crossing this is a salient open/close event
STORAGES = ("mcap", "sqlite3")
IMAGE_MODES = ("compressed", "raw", "both")
ROS_DISTRO = "jazzy"  # the message definitions below are Jazzy's (Stores.ROS2_JAZZY)
BAG_VERSION = 9  # rosbag2 metadata version of Jazzy's recorder (QoS as a YAML list with policy names)
INFINITE_S_NS = (9_223_372_036, 854_775_807)  # RMW_DURATION_INFINITE, as rosbag2 writes an unset duration


@dataclass(frozen=True)
class OfferedQos:
    """One publisher's QoS in rosbag2's terms (the names rmw's *_to_str functions give, as Jazzy writes them)."""
    reliability: str
    durability: str
    depth: int
    history: str = "keep_last"
    liveliness: str = "automatic"


CAMERA_QOS = OfferedQos("best_effort", "volatile", 1)
INSTRUCTION_QOS = OfferedQos("reliable", "transient_local", 1)
RELIABLE_QOS = OfferedQos("reliable", "volatile", 50)


def offered_qos(topic: str) -> OfferedQos:
    """The QoS a bag's topic is recorded with (module docstring says why)."""
    if topic == TOPIC_INSTRUCTION:
        return INSTRUCTION_QOS
    if topic.startswith("/camera"):
        return CAMERA_QOS
    return RELIABLE_QOS


def image_topic(index: int) -> str:
    return TOPIC_IMAGE if index == 0 else f"/camera{index}/image_raw"


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


def _with_distro(metadata_yaml: str) -> str:
    """rosbags writes ``ros_distro: rosbags`` whatever the message definitions; say the distro they are from."""
    import yaml

    doc = yaml.safe_load(metadata_yaml)
    info = doc.get("rosbag2_bagfile_information", doc)  # metadata.yaml nests it, the embedded copy does not
    info["ros_distro"] = ROS_DISTRO
    return yaml.safe_dump(doc, default_flow_style=False, sort_keys=False)


def _rosbags_qos(q: OfferedQos):
    from rosbags.interfaces import Qos, QosDurability, QosHistory, QosLiveliness, QosReliability, QosTime

    infinite = QosTime(*INFINITE_S_NS)
    return Qos(history=QosHistory[q.history.upper()], depth=q.depth,
               reliability=QosReliability[q.reliability.upper()], durability=QosDurability[q.durability.upper()],
               deadline=infinite, lifespan=infinite, liveliness=QosLiveliness[q.liveliness.upper()],
               liveliness_lease_duration=infinite, avoid_ros_namespace_conventions=False)


def _jazzy_writer(path: Path, storage: str):
    """A rosbags Writer whose metadata (metadata.yaml and the storage file's embedded copy) names Jazzy."""
    from rosbags.rosbag2 import StoragePlugin, Writer

    class JazzyWriter(Writer):
        def close(self) -> None:
            storage_close = self.storage.close  # rosbags hands the storage plugin the metadata text to embed
            self.storage.close = lambda version, metadata: storage_close(version, _with_distro(metadata))
            super().close()
            self.metapath.write_text(_with_distro(self.metapath.read_text()))

    plugin = StoragePlugin.MCAP if storage == "mcap" else StoragePlugin.SQLITE3
    return JazzyWriter(path, version=BAG_VERSION, storage_plugin=plugin)


class _BagOut:
    """The rosbags writer plus typed message builders for the topics above."""

    def __init__(self, path: Path, storage: str):
        from rosbags.typesys import Stores, get_typestore

        self.ts = get_typestore(Stores.ROS2_JAZZY)
        self.writer = _jazzy_writer(path, storage)
        self.conns: dict[str, object] = {}
        self.counts: dict[str, int] = {}
        t = self.ts.types
        self.Time, self.Header = t["builtin_interfaces/msg/Time"], t["std_msgs/msg/Header"]
        self.CompressedImage, self.Image = t["sensor_msgs/msg/CompressedImage"], t["sensor_msgs/msg/Image"]
        self.JointState, self.String = t["sensor_msgs/msg/JointState"], t["std_msgs/msg/String"]

    def __enter__(self):
        self.writer.open()
        return self

    def __exit__(self, *exc):
        self.writer.close()

    def header(self, stamp_ns: int, frame_id: str):
        return self.Header(stamp=self.Time(sec=stamp_ns // 1_000_000_000, nanosec=stamp_ns % 1_000_000_000),
                           frame_id=frame_id)

    def write(self, topic: str, msg, stamp_ns: int) -> None:
        msgtype = msg.__msgtype__
        conn = self.conns.get(topic)
        if conn is None:
            conn = self.conns[topic] = self.writer.add_connection(
                topic, msgtype, typestore=self.ts, offered_qos_profiles=[_rosbags_qos(offered_qos(topic))])
        self.writer.write(conn, stamp_ns, self.ts.serialize_cdr(msg, msgtype))
        self.counts[topic] = self.counts.get(topic, 0) + 1


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
    out = Path(out_bag)
    if out.exists():
        if not overwrite:
            raise FileExistsError(f"{out} exists; remove it or pass --overwrite")
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    summary = ConversionSummary(f"{ds.name} {ds.version}", mapping.describe(), str(out), storage)
    period_ns = int(round(1e9 / mapping.rate_hz))
    gap_ns = int(round(episode_gap_s * 1e9))
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
    with _BagOut(out, storage) as bag:
        for ep in ds.episodes(split=split, limit=episodes, issues=summary.issues):
            if ep.num_steps == 0:
                summary.issues.append(RecordIssue(ep.shard, ep.offset, "empty", "episode has no steps; skipped"))
                continue
            action = mapping.action(ep.steps)  # MappingError propagates: a wrong mapping is wrong for all
            instructions = mapping.instructions(ep.steps, ep.num_steps)
            stamps = [ep_start + i * period_ns for i in range(ep.num_steps)]
            _write_episode(bag, ds, mapping, ep, action, instructions, stamps, images)
            summary.episodes += 1
            summary.frames += ep.num_steps
            first_stamp = stamps[0] if first_stamp is None else first_stamp
            last_stamp = stamps[-1]
            ep_start = stamps[-1] + period_ns + gap_ns
            if bar is not None:
                bar.update(1)
                bar.set_postfix(frames=summary.frames, skipped=summary.skipped, refresh=False)
        summary.messages = dict(bag.counts)
    if bar is not None:
        bar.close()
    summary.elapsed_s = time.perf_counter() - t0
    summary.bag_bytes = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    if first_stamp is not None:
        summary.duration_s = (last_stamp - first_stamp) / 1e9
    return summary


def _event(bag: _BagOut, stamp: int, **fields) -> None:
    bag.write(TOPIC_EVENTS, bag.String(data=json.dumps(fields, sort_keys=True)), stamp)


def _write_episode(bag: _BagOut, ds: RLDSDataset, mapping: DatasetMapping, ep: Episode, action: np.ndarray,
                   instructions: list[str], stamps: list[int], images: str) -> None:
    n = ep.num_steps
    _event(bag, stamps[0], event="episode_start", episode=ep.index, steps=n, instruction=instructions[0],
           source=f"{os.path.basename(ep.shard)}@{ep.offset}", rate_hz=mapping.rate_hz)
    frames = []
    for k, key in enumerate(mapping.image_keys):
        spec = ds.step_specs[key]
        frames.append((image_topic(k), spec, ep.steps[key]))
    prev_instruction = None
    open_state = action[0, -1] >= GRIPPER_THRESHOLD
    for i in range(n):
        stamp = stamps[i]
        for topic, spec, values in frames:
            header = bag.header(stamp, "camera" if topic == TOPIC_IMAGE else topic.strip("/").split("/")[0])
            if spec.kind == "image":
                data = bytes(values[i])
                if images in ("compressed", "both"):
                    bag.write(topic + COMPRESSED_SUFFIX, bag.CompressedImage(
                        header=header, format=_image_format(data, spec.encoding),
                        data=np.frombuffer(data, dtype=np.uint8)), stamp)
                if images in ("raw", "both"):
                    _write_raw(bag, topic, header, decode_image(data), stamp)
            else:  # a raw uint8 tensor image (H, W, 3): only sensor_msgs/Image makes sense
                _write_raw(bag, topic, header, np.asarray(values[i]), stamp)
        if instructions[i] != prev_instruction:
            bag.write(TOPIC_INSTRUCTION, bag.String(data=instructions[i]), stamp)
            prev_instruction = instructions[i]
        bag.write(TOPIC_ACTION, bag.JointState(header=bag.header(stamp, "base"), name=list(ACTION_NAMES),
                                               position=action[i].astype(np.float64),
                                               velocity=np.zeros(0, np.float64), effort=np.zeros(0, np.float64)),
                  stamp)
        now_open = action[i, -1] >= GRIPPER_THRESHOLD
        if i > 0 and now_open != open_state:
            _event(bag, stamp, event="gripper_open" if now_open else "gripper_close", episode=ep.index, step=i,
                   gripper=float(action[i, -1]), salient=True)
        open_state = now_open
    _event(bag, stamps[-1], event="episode_end", episode=ep.index, steps=n)


def _write_raw(bag: _BagOut, topic: str, header, rgb: np.ndarray, stamp: int) -> None:
    if rgb.ndim == 2:
        rgb = np.repeat(rgb[:, :, None], 3, axis=2)
    if rgb.ndim != 3 or rgb.shape[2] not in (1, 3, 4):
        raise RLDSError(f"image for {topic} has shape {rgb.shape}, expected (H, W, 3)")
    rgb = np.ascontiguousarray(rgb[:, :, :3] if rgb.shape[2] >= 3 else np.repeat(rgb, 3, axis=2), np.uint8)
    h, w = rgb.shape[:2]
    bag.write(topic, bag.Image(header=header, height=h, width=w, encoding="rgb8", is_bigendian=0, step=w * 3,
                               data=rgb.reshape(-1)), stamp)


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
