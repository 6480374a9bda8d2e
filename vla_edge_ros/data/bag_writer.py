"""The one rosbag2 writer of this package: OXE conversions (data/oxe_to_bag.py) and simulated demonstrations
(sim/demos.py) write their bags through it, so training (data/bag_reader.py, train/) reads both the same way.

Topics (Jazzy message definitions, CDR, rosbag2 metadata version 9 as Jazzy's recorder writes it, so
`ros2 bag play` accepts the bag):

    /camera/image_raw/compressed  sensor_msgs/CompressedImage  encoded frames kept as they are (jpeg/png)
    /camera/image_raw             sensor_msgs/Image (rgb8)      raw frames
    /camera<i>/image_raw[...]     the same for extra cameras (i = 1, 2, ...)
    /vla/instruction              std_msgs/String               at each episode start and whenever it changes
    /vla/recorded_action          sensor_msgs/JointState        name = x y z roll pitch yaw gripper (the runtime's
                                                                names), position = the values
    /vla/episode_events           std_msgs/String (JSON)        episode_start, episode_end, gripper_open/close

Every message of step i of an episode is stamped (header and bag time) at the step's time; :func:`write_episode`
writes one episode's events, instruction, actions and (through a callback) its images in that layout, and
:func:`episode_stamps` lays episodes out at a control rate with a gap between them.

metadata.yaml says ``ros_distro: jazzy`` (rosbags' Writer writes "rosbags"; it is rewritten, in metadata.yaml and
in the copy the storage file embeds) and gives each topic the QoS its publisher offers, in full (history, depth,
reliability, durability, deadline, lifespan, liveliness and its lease, avoid_ros_namespace_conventions), because
`ros2 bag play` offers the recorded profile and falls back to reliable + volatile for a topic without one:
camera topics best effort, keep last 1, volatile (sensor data; no deadline, since the bag plays at the data's
own rate), /vla/instruction reliable + transient local (a late subscriber still gets the task), the other topics
reliable, volatile -- the profiles vla_bag_replay offers (ros/qos.py), but for its re-timed camera's deadline.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from vla_edge_ros.engine.config import DEFAULT_ACTION_NAMES

ACTION_NAMES = DEFAULT_ACTION_NAMES  # the runtime's naming (data/mappings.py re-exports the same tuple)
TOPIC_IMAGE = "/camera/image_raw"
TOPIC_INSTRUCTION = "/vla/instruction"
TOPIC_ACTION = "/vla/recorded_action"
TOPIC_EVENTS = "/vla/episode_events"
COMPRESSED_SUFFIX = "/compressed"
DEFAULT_START_NS = 1_700_000_000 * 1_000_000_000  # fixed epoch so recordings are reproducible
GRIPPER_THRESHOLD = 0.5  # gripper (1 open / 0 closed) crossing this is a salient open/close event
STORAGES = ("mcap", "sqlite3")
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


def prepare_output(path: str | Path, overwrite: bool) -> Path:
    """The bag directory to write: refuse an existing one unless ``overwrite`` (then it is removed)."""
    out = Path(path)
    if out.exists():
        if not overwrite:
            raise FileExistsError(f"{out} exists; remove it or pass --overwrite")
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    return out


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


class BagWriter:
    """The rosbags writer plus typed message builders for the topics above. A context manager."""

    def __init__(self, path: str | Path, storage: str = "mcap"):
        if storage not in STORAGES:
            raise ValueError(f"storage must be one of {', '.join(STORAGES)}, got {storage!r}")
        from rosbags.typesys import Stores, get_typestore

        self.path = Path(path)
        self.ts = get_typestore(Stores.ROS2_JAZZY)
        self.writer = _jazzy_writer(self.path, storage)
        self.conns: dict[str, object] = {}
        self.counts: dict[str, int] = {}
        t = self.ts.types
        self.Time, self.Header = t["builtin_interfaces/msg/Time"], t["std_msgs/msg/Header"]
        self.CompressedImage, self.Image = t["sensor_msgs/msg/CompressedImage"], t["sensor_msgs/msg/Image"]
        self.JointState, self.String = t["sensor_msgs/msg/JointState"], t["std_msgs/msg/String"]

    def __enter__(self) -> "BagWriter":
        self.writer.open()
        return self

    def __exit__(self, *exc) -> None:
        self.writer.close()

    def bytes_written(self) -> int:
        return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())

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

    # ---- the topics of the layout ---------------------------------------------------------------------------
    def raw_image(self, topic: str, rgb: np.ndarray, stamp_ns: int, frame_id: str = "camera") -> None:
        """sensor_msgs/Image rgb8 from (H, W, 3) uint8 (greyscale (H, W) / (H, W, 1) replicated, RGBA cut)."""
        rgb = np.asarray(rgb)
        if rgb.ndim == 2:
            rgb = rgb[:, :, None]
        if rgb.ndim != 3 or rgb.shape[2] not in (1, 3, 4) or rgb.dtype != np.uint8:
            raise ValueError(f"image for {topic} has shape {rgb.shape} {rgb.dtype}, expected (H, W, 3) uint8")
        rgb = np.ascontiguousarray(rgb[:, :, :3] if rgb.shape[2] >= 3 else np.repeat(rgb, 3, axis=2))
        h, w = rgb.shape[:2]
        self.write(topic, self.Image(header=self.header(stamp_ns, frame_id), height=h, width=w, encoding="rgb8",
                                     is_bigendian=0, step=w * 3, data=rgb.reshape(-1)), stamp_ns)

    def compressed_image(self, topic: str, data: bytes, fmt: str, stamp_ns: int, frame_id: str = "camera") -> None:
        """sensor_msgs/CompressedImage on ``topic`` + /compressed, the encoded bytes as they are."""
        self.write(topic + COMPRESSED_SUFFIX, self.CompressedImage(
            header=self.header(stamp_ns, frame_id), format=fmt, data=np.frombuffer(data, dtype=np.uint8)), stamp_ns)

    def instruction(self, text: str, stamp_ns: int) -> None:
        self.write(TOPIC_INSTRUCTION, self.String(data=text), stamp_ns)

    def action(self, values: Sequence[float], stamp_ns: int, names: Sequence[str] = ACTION_NAMES) -> None:
        values = np.asarray(values, dtype=np.float64).reshape(-1)
        if values.shape[0] != len(names):
            raise ValueError(f"action has {values.shape[0]} values for {len(names)} names ({' '.join(names)})")
        self.write(TOPIC_ACTION, self.JointState(header=self.header(stamp_ns, "base"), name=list(names),
                                                 position=values, velocity=np.zeros(0, np.float64),
                                                 effort=np.zeros(0, np.float64)), stamp_ns)

    def event(self, stamp_ns: int, **fields: Any) -> None:
        self.write(TOPIC_EVENTS, self.String(data=json.dumps(fields, sort_keys=True)), stamp_ns)


def episode_stamps(start_ns: int, steps: int, rate_hz: float) -> list[int]:
    """Stamps of the ``steps`` steps of an episode starting at ``start_ns``, one control period apart."""
    if not rate_hz > 0:
        raise ValueError(f"rate_hz must be > 0, got {rate_hz}")
    period_ns = int(round(1e9 / rate_hz))
    return [int(start_ns) + i * period_ns for i in range(steps)]


def next_episode_start(stamps: Sequence[int], rate_hz: float, gap_s: float) -> int:
    """Where the episode after the one with ``stamps`` starts: one period after its last step, plus the gap."""
    return int(stamps[-1]) + int(round(1e9 / rate_hz)) + int(round(gap_s * 1e9))


def write_episode(bag: BagWriter, episode: int, actions: np.ndarray, instructions: Sequence[str],
                  stamps: Sequence[int], write_images: Callable[[int, int], None],
                  start_fields: Mapping[str, Any] | None = None, end_fields: Mapping[str, Any] | None = None) -> None:
    """One episode in the layout above: episode_start, then per step i the images (``write_images(i, stamp)``),
    the instruction when it changes, the action and a salient gripper_open / gripper_close event when the gripper
    crosses GRIPPER_THRESHOLD; then episode_end. ``start_fields`` / ``end_fields`` extend the two events (the
    reader hands them back as the episode's metadata)."""
    actions = np.asarray(actions, dtype=np.float64)
    n = len(stamps)
    if n == 0 or actions.shape != (n, len(ACTION_NAMES)) or len(instructions) != n:
        raise ValueError(f"episode {episode}: {n} stamps, actions {actions.shape}, {len(instructions)} "
                         f"instructions; expected ({n}, {len(ACTION_NAMES)}) actions and one instruction per step")
    bag.event(stamps[0], event="episode_start", episode=episode, steps=n, instruction=instructions[0],
              **dict(start_fields or {}))
    prev_instruction = None
    open_state = actions[0, -1] >= GRIPPER_THRESHOLD
    for i in range(n):
        stamp = int(stamps[i])
        write_images(i, stamp)
        if instructions[i] != prev_instruction:
            bag.instruction(instructions[i], stamp)
            prev_instruction = instructions[i]
        bag.action(actions[i], stamp)
        now_open = actions[i, -1] >= GRIPPER_THRESHOLD
        if i > 0 and now_open != open_state:
            bag.event(stamp, event="gripper_open" if now_open else "gripper_close", episode=episode, step=i,
                      gripper=float(actions[i, -1]), salient=True)
        open_state = now_open
    bag.event(int(stamps[-1]), event="episode_end", episode=episode, steps=n, **dict(end_fields or {}))
