"""ROS message <-> core data conversions (the only place that knows both sides).

Images: sensor_msgs/Image and sensor_msgs/CompressedImage are handed to core.image_convert, which validates
and converts with numpy (the PyPI cv-bridge is a broken ROS 1 port; see README). Bad images raise
ImageRejected with a machine-readable ``reason`` that the camera node counts.

Actions: a tick of the ChunkExecutor (ChunkTick; ActionArbiter's TickDecision has the same fields) becomes
- sensor_msgs/JointState: ``name`` = action dimension names, ``position`` = values, ``header.stamp`` = the
  stamp of the camera frame the action came from (zero for a hold with no source), ``header.frame_id`` =
  the kind ('fresh' | 'repeat' | 'hold'), so a consumer reads kind and provenance without parsing logs;
- diagnostic_msgs/DiagnosticStatus: kind, source stamp, age_ms, seq, reason (and, from a ChunkTick, the step of
  the chunk played) as key/values.

Fresh chunks, edge -> robot (``fresh_action_topic``): a sensor_msgs/JointState with ``name`` = the D action
names and ``position`` = the (H, D) chunk row-major (H * D values: step 0's D values, then step 1's, ...);
H = len(position) / len(name). For H = 1 this is exactly the single-action message it always was. Why not
trajectory_msgs/JointTrajectory here: the steps' times need not travel (the executing side times step k at
``header.stamp + k * its control period``), and H = 1 stays the message every consumer already reads.

Accepted chunks, for controllers that interpolate (``action_trajectory_topic``): trajectory_msgs/JointTrajectory,
``header.stamp`` = the chunk's frame stamp, ``joint_names`` = the action names, one point per step k from the step
due when the executor accepted it (``chunk_to_joint_trajectory``).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from builtin_interfaces.msg import Duration, Time
from diagnostic_msgs.msg import DiagnosticStatus, KeyValue
from sensor_msgs.msg import CompressedImage, Image, JointState
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

from vla_edge_ros.core import image_convert

NS_PER_S = 1_000_000_000
KIND_LEVEL = {
    "fresh": DiagnosticStatus.OK,
    "repeat": DiagnosticStatus.OK,  # an expected fallback between chunks; its rate is watched in /diagnostics
    "hold": DiagnosticStatus.WARN,
}


# ---- time ---------------------------------------------------------------------------------------------
def stamp_to_ns(stamp: Time) -> int:
    return int(stamp.sec) * NS_PER_S + int(stamp.nanosec)


def ns_to_stamp(ns: int | None) -> Time:
    if not ns or ns < 0:
        return Time(sec=0, nanosec=0)
    ns = int(ns)
    return Time(sec=ns // NS_PER_S, nanosec=ns % NS_PER_S)


# ---- images -------------------------------------------------------------------------------------------
def image_msg_to_rgb(msg: Image, max_bytes: int) -> np.ndarray:
    """(H, W, 3) uint8 RGB from a sensor_msgs/Image; raises image_convert.ImageRejected."""
    return image_convert.image_to_rgb(msg.height, msg.width, msg.encoding, msg.step, msg.data,
                                      msg.is_bigendian, max_bytes)


def compressed_msg_to_rgb(msg: CompressedImage, max_bytes: int) -> np.ndarray:
    """(H, W, 3) uint8 RGB from a JPEG/PNG sensor_msgs/CompressedImage; raises image_convert.ImageRejected."""
    return image_convert.compressed_to_rgb(msg.format, msg.data, max_bytes)


def rgb_to_image_msg(img: np.ndarray, encoding: str, stamp_ns: int, frame_id: str = "camera",
                     msg: Image | None = None) -> Image:
    """Publisher side (test camera, bag replay): (H, W, C) uint8 array -> sensor_msgs/Image (tightly packed)."""
    if img.dtype != np.uint8:
        raise ValueError(f"image must be uint8, got {img.dtype}")
    msg = msg or Image()
    msg.header.stamp = ns_to_stamp(stamp_ns)
    msg.header.frame_id = frame_id
    msg.height, msg.width = int(img.shape[0]), int(img.shape[1])
    channels = 1 if img.ndim == 2 else int(img.shape[2])
    msg.encoding = encoding
    msg.is_bigendian = 0
    msg.step = msg.width * channels
    msg.data = np.ascontiguousarray(img).tobytes()  # bytes assignment: ~0.2 ms for VGA (array('B') copy: 0.7 ms)
    return msg


# ---- actions ------------------------------------------------------------------------------------------
def _decision_field(decision: Any, name: str, default: Any = None) -> Any:
    return getattr(decision, name, default)


def tick_to_joint_state(decision: Any, names: Sequence[str], stamp_ns_fallback: int = 0) -> JointState:
    values = np.asarray(decision.values, dtype=np.float64).reshape(-1)
    if len(names) != values.shape[0]:
        raise ValueError(f"{values.shape[0]} action values but {len(names)} names")
    msg = JointState()
    src = _decision_field(decision, "source_stamp_ns") or stamp_ns_fallback
    msg.header.stamp = ns_to_stamp(src)
    msg.header.frame_id = str(decision.kind)
    msg.name = list(names)
    msg.position = values.tolist()
    return msg


def tick_to_status(decision: Any, node_name: str = "vla_action", tick: int | None = None) -> DiagnosticStatus:
    """``tick``: running number of the publisher's ticks (a consumer detects a lost tick by a gap in it)."""
    kind = str(decision.kind)
    src = _decision_field(decision, "source_stamp_ns") or 0
    age = _decision_field(decision, "age_ms")
    st = DiagnosticStatus()
    st.level = KIND_LEVEL.get(kind, DiagnosticStatus.ERROR)
    st.name = f"{node_name}: action"
    st.message = kind if not _decision_field(decision, "reason") else f"{kind}: {decision.reason}"
    st.hardware_id = node_name
    st.values = [
        KeyValue(key="kind", value=kind),
        KeyValue(key="source_stamp_ns", value=str(int(src))),
        KeyValue(key="age_ms", value="nan" if age is None else f"{float(age):.3f}"),
        KeyValue(key="seq", value=str(int(_decision_field(decision, "seq", 0) or 0))),
        KeyValue(key="reason", value=str(_decision_field(decision, "reason", "") or "")),
    ]
    step = _decision_field(decision, "step")
    if step is not None:  # a ChunkTick: the step of the chunk played (-1 for a hold)
        st.values.append(KeyValue(key="step", value=str(int(step))))
    if tick is not None:
        st.values.append(KeyValue(key="tick", value=str(int(tick))))
    return st


def status_to_dict(st: DiagnosticStatus) -> dict[str, str]:
    return {kv.key: kv.value for kv in st.values}


def fresh_chunk_to_msg(chunk: np.ndarray, frame_stamp_ns: int, names: Sequence[str], chunk_seq: int) -> JointState:
    """Edge -> robot: one fresh (H, D) chunk, flattened row-major (module docstring). header.stamp = source
    frame stamp; frame_id carries the chunk seq. ValueError when the chunk does not have len(names) columns."""
    arr = np.asarray(chunk, dtype=np.float64)
    arr = arr.reshape(1, -1) if arr.ndim == 1 else arr
    if arr.ndim != 2 or arr.shape[1] != len(names) or arr.shape[0] < 1:
        raise ValueError(f"chunk has shape {arr.shape}, expected (H >= 1, {len(names)}) for names {list(names)}")
    return fresh_action_to_msg(arr.reshape(-1), frame_stamp_ns, names, chunk_seq)


def msg_to_fresh_chunk(msg: JointState, action_dims: int) -> tuple[np.ndarray, int, list[str]]:
    """Robot side: ((H, D) float64 chunk, frame stamp ns, names); D = len(name), or ``action_dims`` for a
    message without names. ValueError when the positions do not make whole steps. Values are not checked
    here: NaN / inf reach the executor, which rejects and counts them by reason."""
    values = np.asarray(msg.position, dtype=np.float64)
    dims = len(msg.name) if msg.name else int(action_dims)
    if values.ndim != 1 or values.size == 0:
        raise ValueError("fresh chunk has no positions")
    if dims < 1 or values.size % dims:
        raise ValueError(f"fresh chunk has {values.size} positions, not a whole number of steps of {dims} "
                         f"action dims ({list(msg.name) or 'no names'})")
    return values.reshape(-1, dims), stamp_to_ns(msg.header.stamp), list(msg.name)


def fresh_action_to_msg(action: np.ndarray, frame_stamp_ns: int, names: Sequence[str], chunk_seq: int) -> JointState:
    """Edge -> robot: one fresh action (a chunk of H = 1). header.stamp = source frame stamp; frame_id carries
    the chunk seq."""
    values = np.asarray(action, dtype=np.float64).reshape(-1)
    msg = JointState()
    msg.header.stamp = ns_to_stamp(frame_stamp_ns)
    msg.header.frame_id = f"fresh:{int(chunk_seq)}"
    msg.name = list(names)
    msg.position = values.tolist()
    return msg


def msg_to_fresh_action(msg: JointState) -> tuple[np.ndarray, int, list[str]]:
    """Robot side: (values float32, frame stamp ns, names). Raises ValueError on a malformed message."""
    values = np.asarray(msg.position, dtype=np.float64)
    if values.ndim != 1 or values.size == 0:
        raise ValueError("fresh action has no positions")
    if msg.name and len(msg.name) != values.size:
        raise ValueError(f"fresh action has {values.size} positions but {len(msg.name)} names")
    if not np.all(np.isfinite(values)):
        raise ValueError("fresh action contains NaN/inf")
    return values.astype(np.float32), stamp_to_ns(msg.header.stamp), list(msg.name)


def ns_to_duration(ns: int) -> Duration:
    ns = int(ns)
    if ns < 0:
        raise ValueError(f"a duration must be >= 0 ns, got {ns}")
    return Duration(sec=ns // NS_PER_S, nanosec=ns % NS_PER_S)


def due_step(frame_stamp_ns: int, dt_ns: int, now_ns: int, horizon: int) -> int:
    """The chunk step the executor plays at ``now_ns`` (core/executor.py): floor((now - stamp) / dt), at least 0
    (a stamp within the future tolerance is due now), at most H - 1 (a chunk that ran out plays its last step);
    0 for H = 1 (a single step is played whatever its stamp). ValueError for dt <= 0 or H < 1."""
    if int(dt_ns) <= 0 or int(horizon) < 1:
        raise ValueError(f"dt_ns and horizon must be > 0, got {dt_ns}, {horizon}")
    if horizon == 1:
        return 0
    return int(min(max(0, (int(now_ns) - int(frame_stamp_ns)) // int(dt_ns)), horizon - 1))


def chunk_to_joint_trajectory(chunk: np.ndarray, frame_stamp_ns: int, dt_ns: int, names: Sequence[str],
                              now_ns: int) -> JointTrajectory:
    """An accepted (H, D) chunk as a trajectory_msgs/JointTrajectory, for controllers that interpolate.

    header.stamp = ``frame_stamp_ns`` (the chunk's frame: the time its step 0 is planned for); joint_names =
    ``names``; one point per step k from the step due at ``now_ns`` (``due_step``: steps already past when the
    chunk was accepted are left out, as the executor skips them for latency compensation) to H - 1, with
    positions = step k's action and time_from_start = k * ``dt_ns``, relative to header.stamp (so the first
    point's time_from_start is the latency already spent, rounded down to a step). At least one point: a chunk
    accepted after its last step was due keeps that step (what the executor then commands). ValueError for a
    chunk that is not (H >= 1, len(names)) or a dt <= 0."""
    arr = np.asarray(chunk, dtype=np.float64)
    arr = arr.reshape(1, -1) if arr.ndim == 1 else arr
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] != len(names):
        raise ValueError(f"chunk has shape {arr.shape}, expected (H >= 1, {len(names)}) for names {list(names)}")
    first = due_step(frame_stamp_ns, dt_ns, now_ns, arr.shape[0])  # ValueError for dt <= 0
    msg = JointTrajectory()
    msg.header.stamp = ns_to_stamp(frame_stamp_ns)
    msg.joint_names = list(names)
    msg.points = [JointTrajectoryPoint(positions=arr[k].tolist(), time_from_start=ns_to_duration(k * int(dt_ns)))
                  for k in range(first, arr.shape[0])]
    return msg


def key_values(d: dict[str, Any]) -> list[KeyValue]:
    out = []
    for k, v in d.items():
        if isinstance(v, float):
            v = f"{v:.3f}"
        out.append(KeyValue(key=str(k), value=str(v)))
    return out
