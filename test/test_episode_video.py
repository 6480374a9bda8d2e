"""sim/episode_video.py: one episode as a GIF with the action kind drawn on every frame (no ROS, no MuJoCo).

What must hold for the video to be believed: one GIF frame per recorded step (until the bound), the banner in the
colour of the step's kind -- read back from the written GIF, not only from the composed array -- the source
image upscaled by an integer factor to at least the asked width, the episode's result on the last frame, memory
bounded by evenly subsampling a long episode, and bad input refused with a reason."""
from __future__ import annotations

import numpy as np
import pytest

PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from vla_edge_ros.sim.episode_video import (ALL_KINDS, KIND_COLOURS, STRIP_COLOUR, EpisodeVideo,  # noqa: E402
                                             colour_kind, layout_for)

H, W = 64, 128  # the trained policy's image (HxW)
ACTION = [0.004, -0.002, 0.001, 0.0, 0.0, 0.0, 0.5]


def frame(i: int, h: int = H, w: int = W) -> np.ndarray:
    """A frame that differs per step (a moving bright square on a gradient), so no two GIF frames merge."""
    f = np.zeros((h, w, 3), np.uint8)
    f[..., 0] = np.linspace(0, 200, w, dtype=np.uint8)[None, :]
    f[..., 2] = np.linspace(0, 200, h, dtype=np.uint8)[:, None]
    x = (3 * i) % (w - 6)
    f[5:11, x:x + 6] = 255
    return f


def recorded(n: int, kinds=("fresh",), **kw) -> EpisodeVideo:
    v = EpisodeVideo("drawer-close", horizon=200, control_hz=10.0, **kw)
    for i in range(1, n + 1):
        k = kinds[(i - 1) % len(kinds)]
        v.add(frame(i), k, i, ACTION if k in ("fresh", "repeat") else None)
    return v


def gif_frames(path) -> list[np.ndarray]:
    im = Image.open(path)
    out = []
    for k in range(im.n_frames):
        im.seek(k)
        out.append(np.asarray(im.convert("RGB")))
    return out


def test_one_gif_frame_per_step_and_real_time_durations(tmp_path):
    v = recorded(12)
    v.finish(True, 12, "success")
    info = v.write_gif(tmp_path / "ep.gif", end_hold_ms=1500)
    im = Image.open(tmp_path / "ep.gif")
    assert im.n_frames == info["frames"] == v.frame_count == 12
    assert v.kept_steps == list(range(1, 13))
    assert v.durations_ms(1500) == [100] * 11 + [1500]  # 10 Hz control: one step = 100 ms
    im.seek(0)
    assert im.info["duration"] == 100
    assert info["bytes"] == (tmp_path / "ep.gif").stat().st_size > 0
    assert not (tmp_path / "ep.gif.tmp").exists()  # written atomically


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_banner_has_the_colour_of_the_kind_in_the_written_gif(tmp_path, kind):
    v = EpisodeVideo("push", horizon=50)
    v.add(frame(1), "fresh", 1, ACTION)  # a first frame of another kind: the colour must follow the step
    v.add(frame(2), kind, 2, ACTION if kind in ("fresh", "repeat") else None)
    v.add(frame(3), "repeat", 3, ACTION)
    v.write_gif(tmp_path / "k.gif")
    lay = layout_for((H, W))
    frames = gif_frames(tmp_path / "k.gif")
    want = KIND_COLOURS[colour_kind(kind)]
    for y, x in ((0, lay.width - 1), (lay.banner_h - 1, lay.width - 1), (0, 0)):  # corners: never text
        assert tuple(frames[1][y, x]) == want, (kind, y, x)
    assert tuple(frames[0][0, lay.width - 1]) == KIND_COLOURS["fresh"]
    assert tuple(frames[2][0, lay.width - 1]) == KIND_COLOURS["repeat"]


def test_kind_colours_are_distinct_and_sim_holds_are_holds():
    assert len({KIND_COLOURS[k] for k in ("fresh", "repeat", "hold")}) == 3
    assert [colour_kind(k) for k in ("no_action", "stale", "rejected")] == ["hold"] * 3


def test_sizes_and_nearest_upscaling(tmp_path):
    v = recorded(3)
    composed = v.render_frames(min_width=256)
    lay = layout_for((H, W), 256)
    assert (lay.scale, lay.width, lay.image_h) == (2, 256, 128)
    assert all(f.shape == (lay.height, 256, 3) and f.dtype == np.uint8 for f in composed)
    img = composed[1][lay.image_top:lay.strip_top]
    assert np.array_equal(img[::2, ::2], frame(2)) and np.array_equal(img[1::2, 1::2], frame(2))
    info = v.write_gif(tmp_path / "s.gif")
    assert Image.open(tmp_path / "s.gif").size == (info["width"], info["height"]) == (256, lay.height)
    # a width that is not a divisor: the smallest integer factor reaching it; a wide frame is not scaled
    assert layout_for((48, 100), 256).scale == 3 and layout_for((48, 100), 256).width == 300
    assert layout_for((120, 400), 256).scale == 1


def test_last_frame_shows_the_result(tmp_path):
    lay = layout_for((H, W))
    ok = recorded(5)
    ok.finish(True, 5, "success")
    failed = recorded(7)
    failed.finish(False, 7, "horizon")
    unfinished = recorded(4)
    assert ok.result_text().startswith("SUCCESS at step 5")
    assert failed.result_text().startswith("FAILED at step 7 (horizon)")
    assert unfinished.result_text().startswith("STOPPED at step 4")
    corner = (lay.height - 1, lay.width - 1)
    assert tuple(ok.render_frames()[-1][corner]) == KIND_COLOURS["fresh"]
    assert tuple(failed.render_frames()[-1][corner]) == KIND_COLOURS["hold"]
    assert tuple(failed.render_frames()[-2][corner]) == STRIP_COLOUR  # before the end: the action strip
    failed.write_gif(tmp_path / "f.gif")
    assert tuple(gif_frames(tmp_path / "f.gif")[-1][corner]) == KIND_COLOURS["hold"]


def test_long_episode_is_subsampled_evenly_within_the_bound(tmp_path):
    v = recorded(1000, kinds=("fresh", "repeat", "hold", "stale"), max_frames=40)
    assert v.steps_seen == 1000
    assert 20 <= v.frame_count <= 40
    steps = v.kept_steps
    gaps = np.diff(steps)
    assert steps[0] == 1 and steps[-1] == 1000  # the start and the end are in the video
    assert set(gaps[:-1].tolist()) == {v.stride} and 1 <= gaps[-1] <= v.stride and v.stride > 1
    assert len(v._kept) + 1 <= v.max_frames  # frames held in memory, the newest-step slot included
    assert v.durations_ms()[0] == 100 * v.stride  # the GIF still plays in real time
    info = v.write_gif(tmp_path / "long.gif")
    assert Image.open(tmp_path / "long.gif").n_frames == info["frames"] == v.frame_count


def test_recorded_frames_are_copies():
    v = EpisodeVideo("reach")
    f = frame(1)
    v.add(f, "fresh", 1, ACTION)
    f[:] = 0  # the renderer may reuse its buffer
    lay = layout_for((H, W))
    assert v.render_frames()[0][lay.image_top:lay.strip_top].max() == 255


@pytest.mark.parametrize("bad, match", [
    (dict(frame=np.zeros((H, W), np.uint8)), "uint8 RGB"),
    (dict(frame=np.zeros((H, W, 3), np.float32)), "uint8 RGB"),
    (dict(frame=np.zeros((H, W, 4), np.uint8)), "uint8 RGB"),
    (dict(frame=[[0, 0, 0]]), "uint8 RGB"),
    (dict(frame=np.zeros((H + 1, W, 3), np.uint8)), "differs from the episode's first frame"),
    (dict(kind="late"), "kind 'late' is not one of"),
    (dict(step=1), "does not follow step 1"),
    (dict(step=0), "integer >= 1"),
    (dict(action=[0.0] * 6), "7 finite numbers"),
    (dict(action=[float("nan")] * 7), "7 finite numbers"),
])
def test_bad_input_is_refused_with_the_reason(bad, match):
    v = EpisodeVideo("push")
    v.add(frame(1), "fresh", 1, ACTION)
    args = dict(frame=frame(2), kind="repeat", step=2, action=ACTION) | bad
    with pytest.raises(ValueError, match=match):
        v.add(args["frame"], args["kind"], args["step"], args["action"])
    assert v.steps_seen == 1 and v.kept_steps == [1]  # nothing half-recorded


def test_errors_of_the_recorder_as_a_whole(tmp_path):
    with pytest.raises(ValueError, match="max_frames must be >= 2"):
        EpisodeVideo("push", max_frames=1)
    with pytest.raises(ValueError, match="control_hz"):
        EpisodeVideo("push", control_hz=0.0)
    with pytest.raises(ValueError, match="no frames recorded"):
        EpisodeVideo("push").write_gif(tmp_path / "none.gif")
    assert not (tmp_path / "none.gif").exists()
    v = recorded(2)
    v.finish(False, 2, "horizon")
    with pytest.raises(ValueError, match="finished"):
        v.add(frame(3), "fresh", 3, ACTION)
