"""Episodes out of the bags data/bag_writer.py writes (OXE conversions and simulated demonstrations alike).

Training needs, per episode, the frames, the recorded actions, the instruction of each step and the episode's
boundaries and metadata (success, seed, task for sim bags; source for OXE bags). A bag is a flat stream of
messages, so the episodes are rebuilt from the layout's own marks, not from message order (rosbags orders
messages of equal stamps by connection, not by write order):

- an episode spans the stamps from its ``episode_start`` event to its ``episode_end`` event (paired by the
  ``episode`` field; the two events' fields are handed back as ``start`` / ``end``);
- a step is an image and a /vla/recorded_action with the same header stamp inside that span; the instruction
  of a step is the newest /vla/instruction at or before its stamp;
- a bag without any episode event (a plain recording) is one episode, and the summary says so.

Images come from ``/camera/image_raw`` (rgb8 / bgr8 / mono8 Image) or, when the bag has no raw frames, from
``/camera/image_raw/compressed`` (JPEG / PNG, decoded with Pillow). Nothing is dropped silently: an image without
an action, an action without an image, a step outside every episode, an episode without its end (or its start),
an episode whose frame size changes, an unreadable image -- each is counted by reason in :class:`ReadSummary`.
A recorded action whose joint names are not the runtime's (engine/config.py DEFAULT_ACTION_NAMES) is an error
(:class:`BagReadError`): another naming is a different robot interface, not something to guess around.
"""
from __future__ import annotations

import hashlib
import io
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from vla_edge_ros.data.bag_writer import (ACTION_NAMES, COMPRESSED_SUFFIX, TOPIC_ACTION, TOPIC_EVENTS, TOPIC_IMAGE,
                                          TOPIC_INSTRUCTION)

SKIP_REASONS = ("image_without_action", "action_without_image", "outside_episode", "episode_without_end",
                "end_without_start", "frame_size_changed", "image_unreadable", "empty_episode")


class BagReadError(ValueError):
    """A bag this reader cannot take: missing, no image / action topic, or actions in another naming."""


@dataclass
class BagEpisode:
    index: int  # the ``episode`` field of its events (its order in the bag when the bag has none)
    instructions: list[str]  # per step
    frames: np.ndarray  # (T, H, W, 3) uint8
    actions: np.ndarray  # (T, action_dims) float64, the runtime's naming
    stamps_ns: np.ndarray  # (T,) int64
    start: dict[str, Any] = field(default_factory=dict)  # episode_start event fields
    end: dict[str, Any] = field(default_factory=dict)  # episode_end event fields
    bag: str = ""

    @property
    def steps(self) -> int:
        return int(self.actions.shape[0])

    @property
    def instruction(self) -> str:
        return self.instructions[0] if self.instructions else ""

    @property
    def success(self) -> bool | None:
        """True / False for sim demonstrations; None when the bag does not say (OXE)."""
        s = self.end.get("success")
        return None if s is None else bool(s)


@dataclass
class ReadSummary:
    bag: str
    image_topic: str = ""
    episodes: int = 0
    steps: int = 0
    messages: dict[str, int] = field(default_factory=dict)
    skipped: Counter = field(default_factory=Counter)  # reason -> count (SKIP_REASONS)
    notes: list[str] = field(default_factory=list)

    def text(self) -> str:
        skipped = ", ".join(f"{k} {v}" for k, v in sorted(self.skipped.items())) or "none"
        lines = [f"{self.bag}: {self.episodes} episodes, {self.steps} steps from {self.image_topic}; "
                 f"skipped: {skipped}"]
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def _stamp_ns(msg) -> int:
    return int(msg.header.stamp.sec) * 1_000_000_000 + int(msg.header.stamp.nanosec)


def image_to_rgb(msg) -> np.ndarray:
    """sensor_msgs/Image (rgb8, bgr8, rgba8, bgra8, mono8) or CompressedImage (jpeg / png) -> (H, W, 3) uint8."""
    if hasattr(msg, "encoding"):
        channels = {"rgb8": 3, "bgr8": 3, "rgba8": 4, "bgra8": 4, "mono8": 1}.get(msg.encoding)
        if channels is None:
            raise ValueError(f"image encoding {msg.encoding!r} is not one of rgb8 bgr8 rgba8 bgra8 mono8")
        h, w, step = int(msg.height), int(msg.width), int(msg.step)
        raw = np.asarray(msg.data, dtype=np.uint8)
        if step < w * channels or raw.size < h * step:
            raise ValueError(f"image {w}x{h} {msg.encoding}: step {step}, {raw.size} bytes is too short")
        img = raw[:h * step].reshape(h, step)[:, :w * channels].reshape(h, w, channels)
        if msg.encoding.startswith("bgr"):
            img = img[:, :, 2::-1]
        elif channels == 1:
            img = np.repeat(img, 3, axis=2)
        return np.ascontiguousarray(img[:, :, :3])
    from PIL import Image as PILImage

    with PILImage.open(io.BytesIO(bytes(msg.data))) as im:
        return np.asarray(im.convert("RGB"), dtype=np.uint8)


def _episode_spans(events: list[tuple[int, dict]], summary: ReadSummary) -> list[tuple[int, int, dict, dict]]:
    """(start_ns, end_ns, start fields, end fields) of each complete episode, in bag order."""
    spans, open_ = [], {}
    # at one stamp, starts before ends (a one-step episode); ends of other episodes before the new start
    order = {"episode_end": 0, "episode_start": 1}
    for stamp, ev in sorted(events, key=lambda e: (e[0], order.get(e[1].get("event"), 2))):
        kind, ep = ev.get("event"), ev.get("episode")
        if kind == "episode_start":
            if ep in open_:
                summary.skipped["episode_without_end"] += 1
            open_[ep] = (stamp, ev)
        elif kind == "episode_end":
            if ep not in open_:
                summary.skipped["end_without_start"] += 1
                continue
            t0, start = open_.pop(ep)
            spans.append((t0, stamp, start, ev))
    summary.skipped["episode_without_end"] += len(open_)
    return sorted(spans, key=lambda s: s[0])


def read_episodes(bag: str | Path, image_topic: str = TOPIC_IMAGE,
                  action_names: Sequence[str] = ACTION_NAMES) -> tuple[list[BagEpisode], ReadSummary]:
    """All episodes of one bag (module docstring), and what was read and skipped."""
    from rosbags.highlevel import AnyReader
    from rosbags.typesys import Stores, get_typestore

    path = Path(bag)
    if not path.exists():
        raise BagReadError(f"bag {path}: no such file or directory")
    summary = ReadSummary(str(path))
    images: dict[int, Any] = {}
    actions: dict[int, np.ndarray] = {}
    instructions: list[tuple[int, str]] = []
    events: list[tuple[int, dict]] = []
    names = tuple(action_names)
    with AnyReader([path], default_typestore=get_typestore(Stores.ROS2_JAZZY)) as reader:
        topics = {c.topic for c in reader.connections}
        source = image_topic if image_topic in topics else image_topic + COMPRESSED_SUFFIX
        if source not in topics:
            raise BagReadError(f"bag {path}: no {image_topic} or {image_topic}{COMPRESSED_SUFFIX} topic "
                               f"(topics: {', '.join(sorted(topics))})")
        if TOPIC_ACTION not in topics:
            raise BagReadError(f"bag {path}: no {TOPIC_ACTION} topic (topics: {', '.join(sorted(topics))})")
        summary.image_topic = source
        wanted = [c for c in reader.connections if c.topic in (source, TOPIC_ACTION, TOPIC_INSTRUCTION, TOPIC_EVENTS)]
        for conn, bag_t, raw in reader.messages(connections=wanted):
            summary.messages[conn.topic] = summary.messages.get(conn.topic, 0) + 1
            msg = reader.deserialize(raw, conn.msgtype)
            if conn.topic == source:
                images[_stamp_ns(msg)] = msg  # decoded only once it is known to belong to a step
            elif conn.topic == TOPIC_ACTION:
                if tuple(msg.name) != names:
                    raise BagReadError(f"bag {path}: {TOPIC_ACTION} names {list(msg.name)}, expected the runtime's "
                                       f"{list(names)}")
                actions[_stamp_ns(msg)] = np.asarray(msg.position, dtype=np.float64)
            elif conn.topic == TOPIC_INSTRUCTION:
                instructions.append((int(bag_t), str(msg.data)))
            else:
                try:
                    events.append((int(bag_t), json.loads(msg.data)))
                except json.JSONDecodeError:
                    summary.notes.append(f"episode event at {bag_t} is not JSON: {msg.data[:60]!r}")
    instructions.sort(key=lambda x: x[0])
    common = sorted(set(images) & set(actions))
    summary.skipped["image_without_action"] += len(set(images) - set(actions))
    summary.skipped["action_without_image"] += len(set(actions) - set(images))
    spans = _episode_spans(events, summary)
    if not spans and common:
        summary.notes.append("no episode events: the whole bag is read as one episode")
        spans = [(common[0], common[-1], {"episode": 0}, {})]
    episodes, used = [], 0
    stamps = np.asarray(common, dtype=np.int64)
    inst_t = np.asarray([t for t, _ in instructions], dtype=np.int64)
    for k, (t0, t1, start, end) in enumerate(spans):
        sel = stamps[(stamps >= t0) & (stamps <= t1)]
        used += len(sel)
        ep = _build_episode(k, sel, images, actions, instructions, inst_t, start, end, summary)
        if ep is not None:
            ep.bag = str(path)
            episodes.append(ep)
    summary.skipped["outside_episode"] += len(common) - used
    summary.skipped = Counter({k: v for k, v in summary.skipped.items() if v})
    summary.episodes = len(episodes)
    summary.steps = sum(e.steps for e in episodes)
    return episodes, summary


def _build_episode(k, sel, images, actions, instructions, inst_t, start, end, summary) -> BagEpisode | None:
    if len(sel) == 0:
        summary.skipped["empty_episode"] += 1
        return None
    frames = []
    for t in sel:
        try:
            frames.append(image_to_rgb(images[int(t)]))
        except (ValueError, OSError) as exc:
            summary.skipped["image_unreadable"] += 1
            summary.notes.append(f"episode {start.get('episode', k)}: image at {int(t)} unreadable ({exc}); "
                                 "episode skipped")
            return None
    if len({f.shape for f in frames}) != 1:
        summary.skipped["frame_size_changed"] += 1
        return None
    idx = np.searchsorted(inst_t, sel, side="right") - 1
    texts = [instructions[i][1] if i >= 0 else str(start.get("instruction", "")) for i in idx]
    return BagEpisode(index=int(start.get("episode", k)), instructions=texts, frames=np.stack(frames),
                      actions=np.stack([actions[int(t)] for t in sel]), stamps_ns=sel.astype(np.int64),
                      start=dict(start), end=dict(end))


def read_bags(bags: Iterable[str | Path], **kwargs) -> tuple[list[BagEpisode], list[ReadSummary]]:
    """Episodes of several bags in the order given (each bag's in bag order)."""
    episodes, summaries = [], []
    for b in bags:
        eps, s = read_episodes(b, **kwargs)
        episodes += eps
        summaries.append(s)
    return episodes, summaries


def bag_digest(bags: Iterable[str | Path]) -> str:
    """SHA-256 of the bags' messages (per topic: its type, then every message's bag time and CDR bytes), so the
    same data under another directory name or storage plugin has the same identity: the training data's hash."""
    from rosbags.highlevel import AnyReader
    from rosbags.typesys import Stores, get_typestore

    h = hashlib.sha256()
    for b in bags:
        per_topic: dict[str, Any] = {}
        with AnyReader([Path(b)], default_typestore=get_typestore(Stores.ROS2_JAZZY)) as reader:
            for conn, bag_t, raw in reader.messages():
                th = per_topic.get(conn.topic)
                if th is None:
                    th = per_topic[conn.topic] = hashlib.sha256(f"{conn.topic}\0{conn.msgtype}\0".encode())
                th.update(int(bag_t).to_bytes(8, "little", signed=True) + len(raw).to_bytes(8, "little"))
                th.update(raw)
        h.update(b"bag\0")
        for topic in sorted(per_topic):
            h.update(per_topic[topic].digest())
    return h.hexdigest()
