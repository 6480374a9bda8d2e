"""image_convert: raw and compressed conversions, every rejection reason, stamps, frozen detection (the
time rules of the frozen detector and the rejection window are in test_camera_health.py, YUV in
test_yuv422.py)."""
import io
import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from PIL import Image

from vla_edge_ros.core.camera_health import FrozenDetector, RejectionCounter
from vla_edge_ros.core.image_convert import (SUPPORTED_ENCODINGS, ImageRejected, check_stamp, compressed_to_rgb,
                                             image_to_rgb, validate_stamp)

RNG = np.random.default_rng(7)
RGB = RNG.integers(0, 256, size=(5, 7, 3), dtype=np.uint8)


def pack(planes: np.ndarray, pad: int) -> tuple[bytes, int]:
    """Rows of ``planes`` (H, W, C) uint8 with ``pad`` junk bytes per row; returns (data, step)."""
    h = planes.shape[0]
    rows = planes.reshape(h, -1)
    junk = np.full((h, pad), 0xEE, dtype=np.uint8)
    data = np.concatenate([rows, junk], axis=1)
    return data.tobytes(), data.shape[1]


@pytest.mark.parametrize("pad", [0, 3])
@pytest.mark.parametrize("encoding", ["rgb8", "bgr8", "rgba8", "bgra8", "8UC3"])
def test_colour_encodings(encoding, pad):
    if encoding == "rgb8":
        planes = RGB
    elif encoding in ("bgr8", "8UC3"):
        planes = RGB[:, :, ::-1]
    elif encoding == "rgba8":
        planes = np.concatenate([RGB, np.full((5, 7, 1), 9, np.uint8)], axis=2)
    else:
        planes = np.concatenate([RGB[:, :, ::-1], np.full((5, 7, 1), 9, np.uint8)], axis=2)
    data, step = pack(np.ascontiguousarray(planes), pad)
    out = image_to_rgb(5, 7, encoding, step, data)
    assert out.shape == (5, 7, 3) and out.dtype == np.uint8
    np.testing.assert_array_equal(out, RGB)


@pytest.mark.parametrize("encoding", ["mono8", "8UC1"])
def test_mono8(encoding):
    gray = RGB[:, :, 0]
    data, step = pack(gray[:, :, None], 2)
    out = image_to_rgb(5, 7, encoding, step, data)
    assert out.shape == (5, 7, 3)
    for c in range(3):
        np.testing.assert_array_equal(out[:, :, c], gray)


@pytest.mark.parametrize("bigendian", [0, 1])
@pytest.mark.parametrize("encoding", ["mono16", "16UC1"])
def test_mono16_is_scaled_to_8_bits(encoding, bigendian):
    vals = RNG.integers(0, 65536, size=(4, 6), dtype=np.uint16)
    raw = vals.astype(">u2" if bigendian else "<u2").tobytes()
    rows = np.frombuffer(raw, np.uint8).reshape(4, 12)
    data = np.concatenate([rows, np.zeros((4, 4), np.uint8)], axis=1).tobytes()
    out = image_to_rgb(4, 6, encoding, 16, data, is_bigendian=bigendian)
    np.testing.assert_array_equal(out[:, :, 1], (vals >> 8).astype(np.uint8))
    assert out.dtype == np.uint8 and out.shape == (4, 6, 3)


def test_rgb8_is_a_zero_copy_view_of_the_message_buffer():
    buf = bytearray(RGB.tobytes())
    out = image_to_rgb(5, 7, "rgb8", 21, buf)
    assert np.shares_memory(out, np.frombuffer(buf, np.uint8))
    import array
    arr = array.array("B", RGB.tobytes())  # what rclpy hands out for uint8[] fields
    np.testing.assert_array_equal(image_to_rgb(5, 7, "rgb8", 21, arr), RGB)
    np.testing.assert_array_equal(image_to_rgb(5, 7, "rgb8", 21, list(RGB.tobytes())), RGB)
    doubled = np.repeat(np.frombuffer(RGB.tobytes(), np.uint8), 2)
    strided = doubled[::2]  # a non-contiguous buffer (every other byte) is copied once, not rejected
    np.testing.assert_array_equal(image_to_rgb(5, 7, "rgb8", 21, strided), RGB)


@pytest.mark.parametrize("args,reason", [
    ((0, 0, "rgb8", 0, b""), "empty"),
    ((5, 0, "rgb8", 0, b""), "empty"),
    ((-1, 7, "rgb8", 21, b""), "empty"),
    ((5, 7, "nv12", 14, b"\0" * 70), "unknown_encoding"),
    ((5, 7, "yuv422", 14, b"\0" * 70), "odd_width"),
    ((5, 8, "yuyv", 15, b"\0" * 75), "step_mismatch"),
    ((5, 8, "uyvy", 16, b"\0" * 79), "short_data"),
    ((5, 7, "RGB8", 21, b"\0" * 105), "unknown_encoding"),
    ((5, 7, "rgb8", 20, b"\0" * 100), "step_mismatch"),
    ((5, 7, "mono16", 15, b"\0" * 75), "step_mismatch"),
    ((5, 7, "rgb8", 21, b"\0" * 104), "short_data"),
    ((5, 7, "rgb8", 21, b"\0" * 106), "long_data"),
    ((5, 7, "rgb8", 21, 12345), "bad_data"),
])
def test_malformed_raw_images_are_rejected_with_a_reason(args, reason):
    with pytest.raises(ImageRejected) as err:
        image_to_rgb(*args)
    assert err.value.reason == reason
    assert err.value.message and reason in str(err.value)


def test_too_large_is_rejected_before_touching_data():
    with pytest.raises(ImageRejected) as err:
        image_to_rgb(100000, 100000, "rgb8", 300000, b"", max_bytes=1 << 25)
    assert err.value.reason == "too_large"


@settings(max_examples=300, deadline=None)
@given(h=st.integers(-2, 12), w=st.integers(-2, 12), enc=st.sampled_from(list(SUPPORTED_ENCODINGS) + ["bad", ""]),
       step=st.integers(-5, 60), n=st.integers(0, 700), big=st.integers(0, 1))
def test_fuzz_raw_either_valid_image_or_rejection(h, w, enc, step, n, big):
    data = bytes(RNG.integers(0, 256, size=n, dtype=np.uint8))
    try:
        out = image_to_rgb(h, w, enc, step, data, is_bigendian=big)
    except ImageRejected as exc:
        assert exc.reason
        return
    assert out.shape == (h, w, 3) and out.dtype == np.uint8
    assert n == h * step


# ---- compressed ---------------------------------------------------------------------------------------------
def encode(img: np.ndarray, fmt: str, mode=None) -> bytes:
    b = io.BytesIO()
    Image.fromarray(img, mode=mode).save(b, format=fmt)
    return b.getvalue()


def test_png_round_trip_is_exact_and_grey_or_rgba_become_rgb():
    big = RNG.integers(0, 256, size=(48, 64, 3), dtype=np.uint8)
    np.testing.assert_array_equal(compressed_to_rgb("png", encode(big, "PNG")), big)
    gray = big[:, :, 0].copy()
    out = compressed_to_rgb("png", encode(gray, "PNG"))
    np.testing.assert_array_equal(out[:, :, 2], gray)
    rgba = np.concatenate([big, np.full((48, 64, 1), 255, np.uint8)], axis=2)
    np.testing.assert_array_equal(compressed_to_rgb("rgba8; png compressed", encode(rgba, "PNG")), big)


def test_jpeg_decodes_close_to_the_source():
    smooth = np.zeros((64, 96, 3), np.uint8)
    smooth[:, :, 0] = np.linspace(0, 255, 96, dtype=np.uint8)[None, :]
    smooth[:, :, 1] = 128
    out = compressed_to_rgb("jpeg", encode(smooth, "JPEG"))
    assert out.shape == (64, 96, 3)
    assert np.abs(out.astype(int) - smooth.astype(int)).mean() < 4.0


def png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def png_bomb(width: int, height: int) -> bytes:
    """A valid PNG header claiming width x height RGB pixels, followed by a little zero data (a bomb's shape)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", zlib.compress(b"\0" * 100000, 9))
            + png_chunk(b"IEND", b""))


def test_compressed_rejections():
    jpeg = encode(RGB, "JPEG")
    cases = {
        "empty": ("jpeg", b""),
        "bad_compressed": ("jpeg", b"not an image at all"),
        "unknown_format": ("tiff", jpeg),
    }
    for reason, (fmt, data) in cases.items():
        with pytest.raises(ImageRejected) as err:
            compressed_to_rgb(fmt, data)
        assert err.value.reason == reason, (reason, err.value)
    with pytest.raises(ImageRejected) as err:
        compressed_to_rgb("jpeg", jpeg[: len(jpeg) // 2])  # truncated
    assert err.value.reason == "bad_compressed"
    with pytest.raises(ImageRejected) as err:
        compressed_to_rgb("jpeg", jpeg, max_bytes=10)
    assert err.value.reason == "too_large"
    gif = io.BytesIO()
    Image.fromarray(RGB).save(gif, format="GIF")
    with pytest.raises(ImageRejected) as err:
        compressed_to_rgb("", gif.getvalue())  # sniffed content must be JPEG or PNG
    assert err.value.reason == "bad_compressed"


def test_decompression_bomb_is_refused_from_the_header():
    # 5000 x 5000 px decodes to 75 MB of RGB: refused from the header, pixels never decoded
    with pytest.raises(ImageRejected) as err:
        compressed_to_rgb("png", png_bomb(5000, 5000), max_bytes=32 << 20)
    assert err.value.reason == "too_large"
    with pytest.raises(ImageRejected) as err:  # absurd dimensions: Pillow's own bomb guard, still a rejection
        compressed_to_rgb("png", png_bomb(100000, 100000))
    assert err.value.reason in ("too_large", "bad_compressed")


@settings(max_examples=150, deadline=None)
@given(cut=st.integers(0, 400), flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=8))
def test_fuzz_corrupt_compressed_never_escapes(cut, flips):
    data = bytearray(encode(RGB, "JPEG" if cut % 2 else "PNG"))
    for pos, val in flips:
        data[pos % len(data)] = val
    data = bytes(data[: max(1, len(data) - cut)])
    try:
        out = compressed_to_rgb("jpeg", data)
    except ImageRejected as exc:
        assert exc.reason in ("bad_compressed", "too_large", "empty")
        return
    assert out.ndim == 3 and out.shape[2] == 3 and out.dtype == np.uint8


# ---- stamps -------------------------------------------------------------------------------------------------
NOW = 1_700_000_000 * 10**9


def test_validate_stamp():
    assert validate_stamp(1_700_000_000, 5, NOW) is None
    assert validate_stamp(0, 0, NOW) is None  # unstamped publisher
    assert validate_stamp(1_000, 0, NOW) is None  # old bag
    assert validate_stamp(1_700_000_005, 0, NOW) is None  # small clock skew
    assert "negative" in validate_stamp(-1, 0, NOW)
    assert "nanosec" in validate_stamp(1, 1_000_000_000, NOW)
    assert "future" in validate_stamp(1_700_000_000 + 3600, 0, NOW)
    assert validate_stamp(1_700_000_002, 0, NOW, max_future_ms=1000.0) is not None
    assert check_stamp(1_700_000_000, 7, NOW) == NOW + 7
    with pytest.raises(ImageRejected) as err:
        check_stamp(-5, 0, NOW)
    assert err.value.reason == "bad_stamp"


def test_rejection_counter():
    rc = RejectionCounter(window_s=5.0, clock_ns=lambda: 10**9)
    for exc in (ImageRejected("short_data", "a"), ImageRejected("short_data", "b"), ImageRejected("empty", "c")):
        rc.count(exc)
    rc.add("bad_stamp", "d")
    snap = rc.snapshot()
    assert snap == {"total": 4, "by_reason": {"short_data": 2, "empty": 1, "bad_stamp": 1},
                    "last_reason": "bad_stamp", "last_message": "d", "recent": 4,
                    "recent_by_reason": {"short_data": 2, "empty": 1, "bad_stamp": 1}, "window_s": 5.0,
                    "recent_rate_hz": 0.8, "last_age_s": 0.0}


# ---- frozen camera ------------------------------------------------------------------------------------------
def test_frozen_detector_counts_identical_consecutive_frames():
    fd = FrozenDetector(limit=5)
    img = RNG.integers(0, 256, size=(480, 640, 3), dtype=np.uint8)
    period = 33_000_000  # a live 30 Hz camera: every frame differs (noise) ...
    t = iter(range(0, 10**12, period))
    for i in range(10):
        moving = img.copy()
        moving[0, 0, 0] = i
        assert not fd.update(moving, now_ns=next(t))
    # ... until the picture freezes: flagged at the 5th identical frame, as frozen_frame_limit says
    assert [fd.update(img.copy(), now_ns=next(t)) for _ in range(6)] == [False] * 4 + [True, True]
    assert fd.frozen_events == 1 and fd.run_length == 6
    other = img.copy()
    other[0, 0, 0] ^= 1  # a one-pixel change in a sampled row un-freezes
    assert not fd.update(other, now_ns=next(t))
    assert fd.run_length == 1
    assert [fd.update(other, now_ns=next(t)) for _ in range(4)] == [False] * 3 + [True]
    assert fd.frozen_events == 2
    assert not fd.update(img[:240], now_ns=next(t))  # a different shape is different content


def test_frozen_detector_disabled_and_live_limit():
    fd = FrozenDetector(limit=0)
    img = np.zeros((8, 8, 3), np.uint8)
    assert not any(fd.update(img, now_ns=i * 10**7) for i in range(100))
    fd.set_limit(2)
    assert [fd.update(img, now_ns=10**9), fd.update(img, now_ns=2 * 10**9)] == [False, True]
    with pytest.raises(ValueError):
        fd.set_limit(-1)


def test_frozen_detector_accepts_views_from_the_converter():
    fd = FrozenDetector(limit=2)
    data, step = pack(RGB[:, :, ::-1].copy(), 3)
    a = image_to_rgb(5, 7, "bgr8", step, data)  # negative-stride view
    b = image_to_rgb(5, 7, "bgr8", step, bytes(data))
    assert not fd.update(a, now_ns=0) and fd.update(b, now_ns=10**8)
