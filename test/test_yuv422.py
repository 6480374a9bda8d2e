"""YUV 4:2:2 (YUYV / UYVY) -> RGB in image_convert: against an independent per-pixel reference (the BT.601
limited-range equations in floating point, one pixel at a time), known colours encoded with the forward
BT.601 equations, every spelling of the two layouts, row padding, and the rejections (odd width, step, size).
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from vla_edge_ros.core.image_convert import ImageRejected, image_to_rgb

YUYV_NAMES = ("yuv422_yuy2", "yuyv")
UYVY_NAMES = ("yuv422", "uyvy")  # ROS sensor_msgs/image_encodings: YUV422 = "yuv422" is UYVY


def reference_pixel(y: int, u: int, v: int) -> tuple[int, int, int]:
    """BT.601 limited range, as written in the standard (not the fixed-point tables of the code under test)."""
    yy = 1.164 * max(y - 16, 0)
    r = yy + 1.596 * (v - 128)
    g = yy - 0.813 * (v - 128) - 0.391 * (u - 128)
    b = yy + 2.018 * (u - 128)
    return tuple(int(min(255, max(0, round(c)))) for c in (r, g, b))


def reference_image(packed: np.ndarray, layout: str) -> np.ndarray:
    """(H, W*2) packed bytes -> (H, W, 3), one pixel at a time (slow on purpose: the independent reference)."""
    h, row = packed.shape
    out = np.zeros((h, row // 2, 3), np.uint8)
    for r in range(h):
        for m in range(row // 4):
            b0, b1, b2, b3 = (int(x) for x in packed[r, 4 * m:4 * m + 4])
            y0, u, y1, v = (b0, b1, b2, b3) if layout == "yuyv" else (b1, b0, b3, b2)
            out[r, 2 * m] = reference_pixel(y0, u, v)
            out[r, 2 * m + 1] = reference_pixel(y1, u, v)
    return out


def rgb_to_yuv(rgb) -> tuple[int, int, int]:
    """Forward BT.601 limited range (studio swing) for one colour, as a camera would encode it."""
    r, g, b = (c / 255.0 for c in rgb)
    y = 16 + 65.481 * r + 128.553 * g + 24.966 * b
    u = 128 - 37.797 * r - 74.203 * g + 112.0 * b
    v = 128 + 112.0 * r - 93.786 * g - 18.214 * b
    return tuple(int(round(c)) for c in (y, u, v))


def pack(yuv_pairs: np.ndarray, layout: str, pad: int = 0) -> tuple[bytes, int]:
    """(H, W/2, 4) as (Y0, U, Y1, V) -> packed rows in ``layout`` with ``pad`` junk bytes per row."""
    mp = yuv_pairs if layout == "yuyv" else yuv_pairs[:, :, [1, 0, 3, 2]]
    h = mp.shape[0]
    rows = np.concatenate([mp.reshape(h, -1), np.full((h, pad), 0xAB, np.uint8)], axis=1)
    return rows.tobytes(), rows.shape[1]


@pytest.mark.parametrize("name,layout", [(n, "yuyv") for n in YUYV_NAMES] + [(n, "uyvy") for n in UYVY_NAMES])
@pytest.mark.parametrize("pad", [0, 6])
def test_matches_the_per_pixel_reference(name, layout, pad):
    rng = np.random.default_rng(11)
    h, w = 9, 14
    packed = rng.integers(0, 256, (h, w * 2), dtype=np.uint8)
    rows = np.concatenate([packed, np.full((h, pad), 0xAB, np.uint8)], axis=1)
    out = image_to_rgb(h, w, name, w * 2 + pad, rows.tobytes())
    assert out.shape == (h, w, 3) and out.dtype == np.uint8
    ref = reference_image(packed, layout)
    # fixed point vs floating point: rounding may differ by one level, never more
    assert np.abs(out.astype(int) - ref.astype(int)).max() <= 1
    assert np.mean(out == ref) > 0.9


# every 7th level plus the edges of the legal ranges (Y 16..235, U/V 16..240) and of a byte
LEVELS = np.unique(np.r_[np.arange(0, 256, 7), 0, 1, 15, 16, 17, 127, 128, 129, 235, 236, 239, 240, 241, 254, 255])


def test_yuv_grid_matches_the_reference_within_one_level():
    """A dense grid of (Y, U, V) combinations at once: no overflow, saturation right at both ends."""
    n = len(LEVELS)
    y, u, v = np.meshgrid(LEVELS, LEVELS, LEVELS, indexing="ij")
    mp = np.stack([y, u, y, v], axis=-1).astype(np.uint8).reshape(n * n, n, 4)
    out = image_to_rgb(n * n, 2 * n, "yuyv", 4 * n, mp.tobytes()).reshape(n, n, n, 2, 3)
    assert np.array_equal(out[..., 0, :], out[..., 1, :])  # same Y in both pixels of a pair
    yy = 1.164 * np.maximum(y - 16, 0)
    ref = np.stack([yy + 1.596 * (v - 128), yy - 0.813 * (v - 128) - 0.391 * (u - 128), yy + 2.018 * (u - 128)],
                   axis=-1)
    ref = np.clip(np.round(ref), 0, 255)
    assert np.abs(out[..., 0, :].astype(np.float64) - ref).max() <= 1.0


COLOURS = {"black": (0, 0, 0), "white": (255, 255, 255), "red": (255, 0, 0), "green": (0, 255, 0),
           "blue": (0, 0, 255), "grey": (128, 128, 128), "yellow": (255, 255, 0), "orange": (255, 128, 0)}


@pytest.mark.parametrize("layout,name", [("yuyv", "yuv422_yuy2"), ("uyvy", "uyvy")])
@pytest.mark.parametrize("colour", sorted(COLOURS))
def test_known_colours_round_trip(layout, name, colour):
    rgb = COLOURS[colour]
    y, u, v = rgb_to_yuv(rgb)
    mp = np.tile(np.array([y, u, y, v], np.uint8), (4, 3, 1))  # 4 rows x 6 pixels of one colour
    data, step = pack(mp, layout)
    out = image_to_rgb(4, 6, name, step, data)
    assert np.abs(out.astype(int) - np.array(rgb)).max() <= 3, (colour, (y, u, v), out[0, 0])


def test_chroma_is_shared_by_the_two_pixels_of_a_pair_and_luma_is_per_pixel():
    # one macropixel: dark left pixel, bright right pixel, neutral chroma -> two greys, nothing bleeds
    mp = np.array([[[16, 128, 235, 128]]], np.uint8)
    for layout, name in (("yuyv", "yuyv"), ("uyvy", "yuv422")):
        data, step = pack(mp, layout)
        out = image_to_rgb(1, 2, name, step, data)
        np.testing.assert_array_equal(out, [[[0, 0, 0], [255, 255, 255]]])


def test_yuyv_and_uyvy_of_the_same_picture_agree():
    rng = np.random.default_rng(3)
    mp = rng.integers(0, 256, (6, 5, 4), dtype=np.uint8)
    yuyv, yuyv_step = pack(mp, "yuyv", 2)
    uyvy, uyvy_step = pack(mp, "uyvy", 0)
    a = image_to_rgb(6, 10, "yuyv", yuyv_step, yuyv)
    b = image_to_rgb(6, 10, "uyvy", uyvy_step, uyvy)
    np.testing.assert_array_equal(a, b)
    assert a.flags.writeable  # a new array, not a view of the message


@pytest.mark.parametrize("name", YUYV_NAMES + UYVY_NAMES)
def test_rejections(name):
    cases = [
        ((4, 7, name, 14, b"\0" * 56), "odd_width"),
        ((4, 1, name, 2, b"\0" * 8), "odd_width"),
        ((4, 8, name, 15, b"\0" * 60), "step_mismatch"),
        ((4, 8, name, 8, b"\0" * 32), "step_mismatch"),  # step of a 1-byte-per-pixel image
        ((4, 8, name, 16, b"\0" * 63), "short_data"),
        ((4, 8, name, 16, b"\0" * 65), "long_data"),
        ((0, 8, name, 16, b""), "empty"),
    ]
    for args, reason in cases:
        with pytest.raises(ImageRejected) as err:
            image_to_rgb(*args)
        assert err.value.reason == reason, (args, err.value)
    with pytest.raises(ImageRejected) as err:
        image_to_rgb(4, 7, name, 14, b"\0" * 56)
    assert "even" in err.value.message and "7" in err.value.message
    with pytest.raises(ImageRejected) as err:
        image_to_rgb(10000, 10000, name, 20000, b"", max_bytes=1 << 20)
    assert err.value.reason == "too_large"


def test_unknown_encoding_message_lists_the_yuv_names():
    with pytest.raises(ImageRejected) as err:
        image_to_rgb(2, 2, "nv12", 4, b"\0" * 8)
    assert err.value.reason == "unknown_encoding"
    assert all(n in err.value.message for n in YUYV_NAMES + UYVY_NAMES)


@settings(max_examples=60, deadline=None)
@given(h=st.integers(1, 5), half=st.integers(1, 6), pad=st.integers(0, 5), layout=st.sampled_from(["yuyv", "uyvy"]),
       seed=st.integers(0, 2**31))
def test_fuzz_against_the_reference(h, half, pad, layout, seed):
    packed = np.random.default_rng(seed).integers(0, 256, (h, half * 4), dtype=np.uint8)
    rows = np.concatenate([packed, np.zeros((h, pad), np.uint8)], axis=1)
    out = image_to_rgb(h, half * 2, layout, half * 4 + pad, rows.tobytes())
    assert np.abs(out.astype(int) - reference_image(packed, layout).astype(int)).max() <= 1
