"""A robot's camera in the fleet edge's own process (``fleet_camera_process:=false``; ros/fleet_node.py).

Why deferred conversion: N cameras at 60 Hz deliver far more frames than the fleet runs (at
most one per robot and 30 Hz cycle, fewer when batches are full), and every callback competes with the fleet
loop's thread for the cores and the GIL. A raw image in an RGB / BGR / mono layout is checked and converted on
receipt as before (a zero-copy view: microseconds); a JPEG / PNG (``image_transport: compressed``) or YUV 4:2:2
frame (2.7 / 3.7 ms each at 640x480 on this repo's CPU) is only checked for its stamp and size on receipt and
stored as received (``DeferredFrame``); the fleet loop decodes it when a pass takes it (core/fleet_loop.py), so
frames that are overwritten unread are never decoded. A frame whose decoding then fails is counted where the
camera counts every rejection (``rejected``, ``rejected.<reason>`` of ``vla_camera: ingest [<ns>]``) and as the
robot's ``bad_frames``; ``rejected_at_take`` says how many of the rejections were found there. The frozen check
keys on the received bytes of a deferred frame (the whole JPEG, or rows of the YUV data) instead of the pixels.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from vla_edge_ros.core import image_convert
from vla_edge_ros.ros import conversions
from vla_edge_ros.ros.camera_node import CameraNode


@dataclass
class DeferredFrame:
    """A received frame whose pixels are converted by its taker (``convert``, the fleet loop's thread): what a
    ``FleetCameraNode`` writes into the robot's buffer for JPEG / PNG / YUV images. The fields the loop reads of a
    camera_node.CameraFrame (``stamp_ns``, ``frame_id``, ...) are here too."""
    stamp_ns: int
    received_ns: int
    frame_id: int
    header_frame_id: str
    msg: Any  # the received message until converted
    converter: Callable[[Any, int], np.ndarray]  # conversions.*_msg_to_rgb
    max_bytes: int
    on_reject: Callable[[image_convert.ImageRejected], None]  # the camera's count of rejections found at take
    image: Optional[np.ndarray] = None  # the RGB image once converted

    def convert(self) -> np.ndarray:
        """The (H, W, 3) uint8 RGB image (converted once); ImageRejected, counted by the camera, when it is bad."""
        if self.image is None:
            try:
                self.image = self.converter(self.msg, self.max_bytes)
            except image_convert.ImageRejected as exc:
                self.on_reject(exc)
                raise
            self.msg = None  # the received bytes are not needed any more
        return self.image


def _payload(msg: Any, max_bytes: int) -> np.ndarray:
    """The received bytes of a deferred frame as a 2-D uint8 view for the frozen check: rows of a raw image's data
    (the check samples up to 64 rows, as for pixels), the whole of a compressed one (one row: its crc32 covers it
    all; a JPEG's bytes after a change differ from there on). ImageRejected for no data or more than
    ``max_bytes`` (what the conversion would say first)."""
    data = np.frombuffer(image_convert._as_buffer(msg.data), dtype=np.uint8)
    if data.size == 0:
        raise image_convert.ImageRejected("empty", "image has no data")
    if data.size > max_bytes:
        raise image_convert.ImageRejected("too_large", f"data is {data.size} bytes, limit {max_bytes}")
    rows = int(getattr(msg, "height", 0) or 0)
    return data.reshape(rows, -1) if rows > 0 and data.size % rows == 0 else data.reshape(1, -1)


class FleetCameraNode(CameraNode):
    """A robot's camera in the fleet edge: camera_node.CameraNode with JPEG / PNG / YUV decoding left to the frame's
    taker (module docstring, "Deferred conversion")."""

    def __init__(self, *args, **kwargs) -> None:
        self.deferred = self.rejected_at_take = 0
        super().__init__(*args, **kwargs)

    @staticmethod
    def _deferred_kind(msg: Any, convert: Callable) -> bool:
        return convert is not conversions.image_msg_to_rgb or msg.encoding in image_convert.YUV422_ENCODINGS

    def _convert(self, msg, convert) -> np.ndarray:
        if not self._deferred_kind(msg, convert):  # RGB / BGR / mono: a view, checked and made on receipt
            return super()._convert(msg, convert)
        return _payload(msg, self.params.get("max_image_bytes"))

    def _make_frame(self, img, msg, convert, stamp_ns: int, now_ns: int) -> Any:
        if not self._deferred_kind(msg, convert):
            return super()._make_frame(img, msg, convert, stamp_ns, now_ns)
        self.deferred += 1
        return DeferredFrame(stamp_ns, now_ns, self._next_frame_id, msg.header.frame_id, msg, convert,
                             self.params.get("max_image_bytes"), self._rejected_at_take)

    def _rejected_at_take(self, exc: image_convert.ImageRejected) -> None:
        """From the fleet loop's thread: the rejection counter is thread-safe, the log is throttled."""
        self.rejected_at_take += 1
        self._reject(exc.reason, f"{exc} (found when the fleet loop took the frame)")

    def snapshot(self) -> dict:
        return {**super().snapshot(), "deferred_frames": self.deferred, "rejected_at_take": self.rejected_at_take}
