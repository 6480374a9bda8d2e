"""sensor_msgs/Image and CompressedImage payloads -> (H, W, 3) uint8 RGB arrays, without cv_bridge.

The PyPI ``cv-bridge`` is a broken ROS 1 port, so conversion is plain numpy: ``np.frombuffer`` over the message
buffer honouring ``step`` (row padding), then views (slicing / channel reversal / broadcasting) instead of
copies wherever the layout allows. The returned array may therefore be a read-only view sharing the message's
memory (it keeps the buffer alive); callers that need to write into it must copy.

Every malformed input raises ``ImageRejected`` with a short ``reason`` code (counted per reason by
``RejectionCounter``) and a message saying what was wrong; nothing here lets a bad message crash a node.
"""
from __future__ import annotations

import io
import threading
import zlib
from typing import Any, Optional

import numpy as np

DEFAULT_MAX_BYTES = 32 * 1024 * 1024
MAX_FUTURE_MS_DEFAULT = 10_000.0

# encoding -> (channels in the message, bytes per channel)
ENCODINGS: dict[str, tuple[int, int]] = {
    "rgb8": (3, 1),
    "bgr8": (3, 1),
    "rgba8": (4, 1),
    "bgra8": (4, 1),
    "mono8": (1, 1),
    "8UC1": (1, 1),
    "8UC3": (3, 1),  # OpenCV convention: treated as bgr8
    "mono16": (1, 2),
    "16UC1": (1, 2),
}


class ImageRejected(Exception):
    """A message that cannot be turned into an image. ``reason`` is a short code for counting."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


def _nbytes(data: Any) -> int:
    try:
        return memoryview(data).nbytes
    except TypeError:
        pass
    try:
        return len(data)
    except TypeError:
        raise ImageRejected("bad_data", f"image data is not a byte sequence ({type(data).__name__})") from None


def _as_buffer(data: Any) -> Any:
    """bytes / bytearray / array.array / memoryview / numpy pass through; a list (rare) is packed once."""
    try:
        view = memoryview(data)
        return data if view.c_contiguous else view.tobytes()  # np.frombuffer needs one contiguous block
    except TypeError:
        try:
            return bytes(data)
        except (TypeError, ValueError) as exc:
            raise ImageRejected("bad_data", f"image data is not a byte buffer ({type(data).__name__}): {exc}")


def image_to_rgb(height: int, width: int, encoding: str, step: int, data: Any, is_bigendian: int = 0,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> np.ndarray:
    """Raw sensor_msgs/Image fields -> (height, width, 3) uint8 RGB (often a zero-copy view)."""
    if height <= 0 or width <= 0:
        raise ImageRejected("empty", f"image is {width}x{height}")
    if encoding not in ENCODINGS:
        raise ImageRejected("unknown_encoding", f"encoding {encoding!r} is not one of {', '.join(ENCODINGS)}")
    channels, depth = ENCODINGS[encoding]
    row_bytes = width * channels * depth
    if step < row_bytes:
        raise ImageRejected("step_mismatch", f"step {step} is below width*bytes_per_pixel = {row_bytes} "
                                             f"({width} px x {channels * depth} B, {encoding})")
    if depth > 1 and step % depth:
        raise ImageRejected("step_mismatch", f"step {step} is not a multiple of the {depth}-byte pixel depth")
    expected = height * step
    if expected > max_bytes:
        raise ImageRejected("too_large", f"{width}x{height} with step {step} is {expected} bytes, limit {max_bytes}")
    size = _nbytes(data)
    if size < expected:
        raise ImageRejected("short_data", f"data has {size} bytes, height*step = {expected}")
    if size > expected:
        raise ImageRejected("long_data", f"data has {size} bytes, height*step = {expected}")
    buf = _as_buffer(data)

    if depth == 1:
        rows = np.frombuffer(buf, dtype=np.uint8, count=expected).reshape(height, step)
        pix = rows[:, :row_bytes].reshape(height, width, channels)  # view, even with row padding
        if encoding in ("rgb8",):
            return pix
        if encoding in ("bgr8", "8UC3"):
            return pix[:, :, ::-1]
        if encoding == "rgba8":
            return pix[:, :, :3]
        if encoding == "bgra8":
            return pix[:, :, 2::-1]
        return np.broadcast_to(pix, (height, width, 3))  # mono8 / 8UC1: one plane seen three times
    # 16-bit mono: scale to 8 bits by keeping the high byte (full 16-bit range -> 0..255); one small copy.
    dtype = np.dtype(">u2" if is_bigendian else "<u2")
    rows16 = np.frombuffer(buf, dtype=dtype, count=expected // 2).reshape(height, step // 2)
    gray = (rows16[:, :width] >> 8).astype(np.uint8)
    return np.broadcast_to(gray[:, :, None], (height, width, 3))


def compressed_to_rgb(format: str, data: Any, max_bytes: int = DEFAULT_MAX_BYTES) -> np.ndarray:
    """sensor_msgs/CompressedImage (JPEG or PNG) -> (H, W, 3) uint8 RGB, with decompression-bomb guards.

    The declared ``format`` (e.g. 'jpeg', 'png', 'rgb8; jpeg compressed bgr8') is advisory: the content is
    sniffed by Pillow and only JPEG and PNG are decoded. Before pixels are decoded the header's dimensions are
    checked so the decoded RGB image stays within ``max_bytes``.
    """
    size = _nbytes(data)
    if size == 0:
        raise ImageRejected("empty", "compressed image has no data")
    if size > max_bytes:
        raise ImageRejected("too_large", f"compressed data is {size} bytes, limit {max_bytes}")
    try:
        from PIL import Image
    except ImportError as exc:  # pragma: no cover - Pillow is a declared dependency
        raise ImageRejected("bad_compressed", f"Pillow is not installed: {exc}")
    fmt = (format or "").lower()
    if fmt and not any(k in fmt for k in ("jpeg", "jpg", "png")):
        raise ImageRejected("unknown_format", f"compressed format {format!r} is neither JPEG nor PNG")
    try:
        img = Image.open(io.BytesIO(bytes(_as_buffer(data))), formats=("JPEG", "PNG"))
    except Exception as exc:  # UnidentifiedImageError, OSError, SyntaxError, ...
        raise ImageRejected("bad_compressed", f"not a decodable JPEG/PNG ({type(exc).__name__}: {exc})")
    with img:
        w, h = img.size
        if w <= 0 or h <= 0:
            raise ImageRejected("empty", f"compressed image is {w}x{h}")
        if w * h * 3 > max_bytes:
            raise ImageRejected("too_large", f"compressed image decodes to {w}x{h} RGB = {w * h * 3} bytes, "
                                             f"limit {max_bytes}")
        try:
            rgb = img.convert("RGB") if img.mode != "RGB" else img
            rgb.load()
            arr = np.asarray(rgb, dtype=np.uint8)
        except Exception as exc:  # truncated / corrupt stream, DecompressionBombError, ...
            raise ImageRejected("bad_compressed", f"{img.format} data is corrupt ({type(exc).__name__}: {exc})")
    if arr.shape != (h, w, 3):
        raise ImageRejected("bad_compressed", f"decoded to shape {arr.shape}, expected {(h, w, 3)}")
    return arr


def validate_stamp(sec: int, nanosec: int, now_ns: int, max_future_ms: float = MAX_FUTURE_MS_DEFAULT) -> Optional[str]:
    """None for a plausible header stamp, else why it is absurd. A zero stamp (unstamped publisher) is allowed;
    stamps in the past are allowed (bag replay); stamps more than ``max_future_ms`` ahead of ``now_ns`` are not."""
    if sec < 0 or nanosec < 0:
        return f"negative stamp {sec}s {nanosec}ns"
    if nanosec >= 1_000_000_000:
        return f"nanosec {nanosec} is not below 1e9"
    stamp_ns = sec * 1_000_000_000 + nanosec
    ahead_ms = (stamp_ns - now_ns) / 1e6
    if ahead_ms > max_future_ms:
        return f"stamp is {ahead_ms:.0f} ms in the future (limit {max_future_ms:.0f} ms)"
    return None


def check_stamp(sec: int, nanosec: int, now_ns: int, max_future_ms: float = MAX_FUTURE_MS_DEFAULT) -> int:
    """Raising form of ``validate_stamp``: the stamp in ns, or ImageRejected('bad_stamp', why)."""
    why = validate_stamp(sec, nanosec, now_ns, max_future_ms)
    if why is not None:
        raise ImageRejected("bad_stamp", why)
    return int(sec) * 1_000_000_000 + int(nanosec)


class RejectionCounter:
    """Rejections per reason code, total and the last message (for /diagnostics). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.total = 0
        self.last_reason = ""
        self.last_message = ""

    def add(self, reason: str, message: str = "") -> None:
        with self._lock:
            self.counts[reason] = self.counts.get(reason, 0) + 1
            self.total += 1
            self.last_reason = reason
            self.last_message = message

    def count(self, exc: ImageRejected) -> None:
        self.add(exc.reason, exc.message)

    def snapshot(self) -> dict:
        with self._lock:
            return {"total": self.total, "by_reason": dict(self.counts), "last_reason": self.last_reason,
                    "last_message": self.last_message}


class FrozenDetector:
    """Flags a frozen camera: ``limit`` consecutive frames with identical content (0 disables the check).

    The content key is crc32 over a strided subsample (up to ~64 full rows, every pixel in them) plus the
    shape: about 0.05 ms for 640x480 instead of hashing 900 KB. A live sensor's noise changes every row, so a
    real frame never repeats the sampled rows exactly; a change confined to unsampled rows is missed, which
    only delays detection of a frozen feed (the cost of a false "frozen" is a hold, so we keep it unlikely).
    """

    def __init__(self, limit: int = 30, max_rows: int = 64) -> None:
        self.set_limit(limit)
        self.max_rows = max(1, int(max_rows))
        self._last_key: Optional[tuple] = None
        self.run_length = 0  # consecutive identical frames including the first of the run
        self.frozen = False
        self.frozen_events = 0  # transitions into the frozen state

    def set_limit(self, limit: int) -> None:
        if int(limit) < 0:
            raise ValueError(f"frozen_frame_limit must be >= 0, got {limit}")
        self.limit = int(limit)

    def key(self, image: np.ndarray) -> tuple:
        h = image.shape[0]
        stride = max(1, h // self.max_rows)
        sample = image[::stride]
        if sample.ndim == 3 and sample.strides[2] <= 0:
            # Views from image_to_rgb: undo a channel reversal (bgr) or a broadcast (mono) so the sample is
            # gathered from contiguous memory; a fixed transform, so equal frames still give equal keys.
            sample = sample[:, :, :1] if sample.strides[2] == 0 else sample[:, :, ::-1]
        sample = np.ascontiguousarray(sample)
        return (image.shape, str(image.dtype), zlib.crc32(sample))

    def update(self, image: np.ndarray) -> bool:
        """Feed one frame; returns True while the camera is considered frozen."""
        if self.limit == 0:
            self._last_key, self.run_length, self.frozen = None, 0, False
            return False
        k = self.key(image)
        if k == self._last_key:
            self.run_length += 1
        else:
            self._last_key, self.run_length = k, 1
        was = self.frozen
        self.frozen = self.run_length >= self.limit
        if self.frozen and not was:
            self.frozen_events += 1
        return self.frozen
