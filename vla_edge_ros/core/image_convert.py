"""sensor_msgs/Image and CompressedImage payloads -> (H, W, 3) uint8 RGB arrays, without cv_bridge.

The PyPI ``cv-bridge`` is a broken ROS 1 port, so conversion is plain numpy: ``np.frombuffer`` over the message
buffer honouring ``step`` (row padding), then views (slicing / channel reversal / broadcasting) instead of
copies wherever the layout allows. The returned array may therefore be a read-only view sharing the message's
memory (it keeps the buffer alive); callers that need to write into it must copy.

YUV 4:2:2 (YUYV / UYVY, what many USB camera drivers publish) is the one layout that needs arithmetic: two
pixels share one U and one V byte, so it is converted (BT.601 limited range, OpenCV's integer formula) into a
new array with a few table look-ups over the whole image, never a per-pixel Python loop.

Every malformed input raises ``ImageRejected`` with a short ``reason`` code (counted per reason by
``camera_health.RejectionCounter``) and a message saying what was wrong; nothing here lets a bad message crash
a node.
"""
from __future__ import annotations

import io
from typing import Any, Optional

import numpy as np

# Moved to core.camera_health (they judge the camera over time); still importable from here.
from vla_edge_ros.core.camera_health import FrozenDetector, RejectionCounter  # noqa: F401

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

# YUV 4:2:2, two pixels per 4-byte macropixel: encoding -> byte offsets of (Y0, U, Y1, V) inside it.
# In ROS sensor_msgs/image_encodings "yuv422" is UYVY and "yuv422_yuy2" is YUYV; "uyvy"/"yuyv" are the
# newer spellings of the same two layouts.
YUV422_ENCODINGS: dict[str, tuple[int, int, int, int]] = {
    "yuv422_yuy2": (0, 1, 2, 3),
    "yuyv": (0, 1, 2, 3),
    "yuv422": (1, 0, 3, 2),
    "uyvy": (1, 0, 3, 2),
}
SUPPORTED_ENCODINGS: tuple[str, ...] = tuple(ENCODINGS) + tuple(YUV422_ENCODINGS)

# BT.601 limited range ("video" levels: Y 16..235, U/V 16..240 around 128) in OpenCV's 20-bit fixed point
# (COLOR_YUV2RGB_YUYV / _UYVY): R = 1.164(Y-16) + 1.596(V-128), G = 1.164(Y-16) - 0.813(V-128) - 0.391(U-128),
# B = 1.164(Y-16) + 2.018(U-128), rounded, saturated to 0..255 (the largest sum fits int32). R depends on
# (Y, V) only and B on (Y, U): each is one 64 KB table indexed by chroma << 8 | luma. G needs all three, so it
# is summed from per-byte tables.
_SHIFT = 20
_Y_TERM = np.maximum(np.arange(256, dtype=np.int32) - 16, 0) * np.int32(1220542)
_C = np.arange(256, dtype=np.int32) - 128
_ROUND = np.int32(1 << (_SHIFT - 1))
_G_FROM_U = _ROUND + _C * np.int32(-409993)
_G_FROM_V = _C * np.int32(-852492)
_R_TABLE = np.clip((_Y_TERM[None, :] + (_ROUND + _C * np.int32(1673527))[:, None]) >> _SHIFT, 0, 255
                   ).astype(np.uint8).ravel()
_B_TABLE = np.clip((_Y_TERM[None, :] + (_ROUND + _C * np.int32(2116026))[:, None]) >> _SHIFT, 0, 255
                   ).astype(np.uint8).ravel()
del _C


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
    if encoding in YUV422_ENCODINGS:
        if width % 2:
            raise ImageRejected("odd_width", f"{encoding} packs two pixels per 4 bytes (shared U and V), so the "
                                             f"width must be even, got {width}")
        channels, depth = 2, 1  # 2 bytes per pixel on average
    elif encoding in ENCODINGS:
        channels, depth = ENCODINGS[encoding]
    else:
        raise ImageRejected("unknown_encoding",
                            f"encoding {encoding!r} is not one of {', '.join(SUPPORTED_ENCODINGS)}")
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

    if encoding in YUV422_ENCODINGS:
        rows = np.frombuffer(buf, dtype=np.uint8, count=expected).reshape(height, step)
        return yuv422_to_rgb(rows[:, :row_bytes].reshape(height, width // 2, 4), YUV422_ENCODINGS[encoding])
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


def yuv422_to_rgb(macropixels: np.ndarray, offsets: tuple[int, int, int, int]) -> np.ndarray:
    """(H, W/2, 4) uint8 macropixels with (Y0, U, Y1, V) at ``offsets`` -> (H, W, 3) uint8 RGB (a new array).

    BT.601 limited range, bit-exact with OpenCV's YUV422 conversion (compared with opencv-python 5.0 over all
    2^24 Y/U/V values when this was written). Whole-image numpy passes, twice (the macropixel's left and right
    pixel share its U and V): a few ms for 640x480, the one raw encoding that costs more than a view."""
    oy0, ou, oy1, ov = offsets
    h, half = macropixels.shape[:2]
    u, v = macropixels[:, :, ou], macropixels[:, :, ov]
    u_high = u.astype(np.uint16) << 8
    v_high = v.astype(np.uint16) << 8
    g_chroma = _G_FROM_U.take(u) + _G_FROM_V.take(v)
    out = np.empty((h, half, 2, 3), dtype=np.uint8)
    index = np.empty((h, half), dtype=np.uint16)
    for pixel, oy in enumerate((oy0, oy1)):
        y = macropixels[:, :, oy]
        np.bitwise_or(v_high, y, out=index)
        out[:, :, pixel, 0] = _R_TABLE.take(index)
        np.bitwise_or(u_high, y, out=index)
        out[:, :, pixel, 2] = _B_TABLE.take(index)
        g = _Y_TERM.take(y)
        g += g_chroma
        g >>= _SHIFT
        np.clip(g, 0, 255, out=g)
        out[:, :, pixel, 1] = g
    return out.reshape(h, 2 * half, 3)


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
