"""One episode of the closed loop as an animated GIF: each control step's camera frame with the action kind on it.

Why: a success rate says *whether* the policy solved the task; a video of one episode shows *how*, and with the
kind of every applied action drawn on its frame (fresh green, repeat amber, hold red) it shows what the runtime's
fallbacks did to the arm -- a stretch of repeats while chunks were refused, holds while the camera was stale.

:class:`EpisodeVideo` collects, per control step, the newest camera frame the sim had published before the step
(the sim node passes the image it already rendered: nothing is rendered twice), the kind of action the step
applied, the step number and the 7-dim action. ``write_gif`` composes the frames -- upscaled (nearest
neighbour, an integer factor) to at least ``min_width`` pixels, a banner above in the kind's colour with the kind
and step, a strip below with the applied action, and on the last frame the episode's result (success / failed
at step N) -- and writes them with Pillow (imported there, so recording needs numpy only).

Kinds: 'fresh', 'repeat', 'hold' (the runtime's kinds, applied as received), and the sim's own holds by reason
('no_action', 'stale', 'rejected': sim/episode.py), drawn in the hold colour as "SIM HOLD (<reason>)".

Bounded memory: at most ``max_frames`` frames are kept, at the source resolution. Once the buffer is full every
other kept frame is dropped and from then on only every ``stride``-th step is kept (the stride doubles each time),
so a long episode is evenly subsampled, never truncated; the newest step is always kept besides, so the last
frame shows how the episode ended. Each GIF frame then lasts ``stride`` control periods, so the GIF plays in
real time. A 128x64 frame is 24 KiB: the default 240 frames hold under 6 MiB.

GIF colours: one palette for the whole GIF, its first entries the banner colours exactly (the rest an adaptive
palette of sample frames), so a banner pixel reads back as its colour and unchanged areas between frames are
stored once. Pure: numpy, Pillow; no ROS, no MuJoCo.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from vla_edge_ros.sim.action_map import GRIPPER, KINDS, RUNTIME_ACTION_NAMES, X, Y, Z
from vla_edge_ros.sim.episode import SIM_HOLD_REASONS

KIND_COLOURS: dict[str, tuple[int, int, int]] = {"fresh": (30, 170, 60), "repeat": (255, 176, 0),
                                                  "hold": (210, 30, 30)}
TEXT_ON: dict[str, tuple[int, int, int]] = {"fresh": (0, 0, 0), "repeat": (0, 0, 0), "hold": (255, 255, 255)}
STRIP_COLOUR = (32, 32, 32)  # the strip below the image (action text)
STOPPED_COLOUR = (90, 90, 90)  # the result strip of an episode that did not finish (the node was stopped)
WHITE, BLACK = (255, 255, 255), (0, 0, 0)
FIXED_PALETTE = (KIND_COLOURS["fresh"], KIND_COLOURS["repeat"], KIND_COLOURS["hold"], STRIP_COLOUR,
                 STOPPED_COLOUR, WHITE, BLACK)
ALL_KINDS = tuple(KINDS) + tuple(SIM_HOLD_REASONS)
DEFAULT_MAX_FRAMES = 240
DEFAULT_MIN_WIDTH = 256
MIN_FRAME_MS = 20  # shorter GIF frame durations are slowed down by most viewers
NEAR_FIXED = 12  # adaptive palette entries this close (per channel) to a banner colour are dropped


def colour_kind(kind: str) -> str:
    """The colour class of a recorded kind: a sim hold is a hold."""
    return kind if kind in KIND_COLOURS else "hold"


@dataclass(frozen=True)
class Layout:
    """Where things are in a composed frame (pixels): banner rows [0, banner_h), image rows [banner_h,
    banner_h + image_h), the action / result strip below; the right-most ``pad`` columns of banner and strip
    never carry text."""
    scale: int
    width: int
    image_h: int
    banner_h: int
    pad: int
    font_px: int

    @property
    def height(self) -> int:
        return self.banner_h + self.image_h + self.banner_h

    @property
    def image_top(self) -> int:
        return self.banner_h

    @property
    def strip_top(self) -> int:
        return self.banner_h + self.image_h


def layout_for(frame_hw: tuple[int, int], min_width: int = DEFAULT_MIN_WIDTH) -> Layout:
    h, w = int(frame_hw[0]), int(frame_hw[1])
    if h < 1 or w < 1:
        raise ValueError(f"frame size must be positive, got {h}x{w}")
    if min_width < 1:
        raise ValueError(f"min_width must be >= 1 px, got {min_width}")
    scale = max(1, math.ceil(min_width / w))
    width = w * scale
    font_px = max(10, min(24, width // 20))
    pad = max(3, font_px // 3)
    return Layout(scale, width, h * scale, font_px + 2 * pad, pad, font_px)


@dataclass(frozen=True)
class VideoStep:
    frame: np.ndarray  # (H, W, 3) uint8, a private copy
    kind: str
    step: int
    action: Optional[tuple[float, ...]]  # the applied 7-dim action; None for holds


class EpisodeVideo:
    """Frames of one episode, bounded (see the module docstring); ``add`` per control step, ``finish`` at the end,
    then ``write_gif``."""

    def __init__(self, task: str, horizon: int = 0, control_hz: float = 10.0,
                 max_frames: int = DEFAULT_MAX_FRAMES):
        if max_frames < 2:
            raise ValueError(f"max_frames must be >= 2 (the subsampled steps plus the last), got {max_frames}")
        if not (control_hz > 0 and math.isfinite(control_hz)):
            raise ValueError(f"control_hz must be a positive number, got {control_hz}")
        if horizon < 0:
            raise ValueError(f"horizon must be >= 0 (0 = not shown), got {horizon}")
        self.task, self.horizon, self.control_hz = str(task), int(horizon), float(control_hz)
        self.max_frames = int(max_frames)
        self.stride = 1
        self.steps_seen = 0  # add() calls accepted
        self._kept: list[VideoStep] = []  # steps 0, stride, 2 * stride, ... of the add() calls
        self._last: Optional[VideoStep] = None  # the newest step (kept even when the stride skips it)
        self._shape: Optional[tuple[int, ...]] = None
        self.result: Optional[tuple[bool, int, str]] = None  # (success, steps, end) once finished

    # ---- recording -----------------------------------------------------------------------------------
    def add(self, frame: np.ndarray, kind: str, step: int, action: Optional[Sequence[float]] = None) -> bool:
        """Record one control step; returns whether its frame is kept beyond the newest-step slot."""
        if self.result is not None:
            raise ValueError("the episode is finished: no more steps can be added")
        if not (isinstance(frame, np.ndarray) and frame.dtype == np.uint8 and frame.ndim == 3
                and frame.shape[2] == 3):
            got = (f"{frame.dtype} array of shape {frame.shape}" if isinstance(frame, np.ndarray)
                   else type(frame).__name__)
            raise ValueError(f"frame must be an (H, W, 3) uint8 RGB array, got {got}")
        if self._shape is not None and frame.shape != self._shape:
            raise ValueError(f"frame shape {frame.shape} differs from the episode's first frame {self._shape}")
        if kind not in ALL_KINDS:
            raise ValueError(f"kind {kind!r} is not one of {', '.join(ALL_KINDS)}")
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 1:
            raise ValueError(f"step must be an integer >= 1, got {step!r}")
        if self._last is not None and step <= self._last.step:
            raise ValueError(f"step {step} does not follow step {self._last.step}")
        act = None
        if action is not None:
            a = np.asarray(action, dtype=np.float64).reshape(-1)
            if a.shape[0] != len(RUNTIME_ACTION_NAMES) or not np.all(np.isfinite(a)):
                raise ValueError(f"action must be {len(RUNTIME_ACTION_NAMES)} finite numbers "
                                 f"({' '.join(RUNTIME_ACTION_NAMES)}), got {a.tolist()}")
            act = tuple(float(v) for v in a)
        self._shape = frame.shape
        rec = VideoStep(np.array(frame, copy=True), kind, int(step), act)
        index = self.steps_seen
        self.steps_seen += 1
        self._last = rec
        if index % self.stride:
            return False
        if len(self._kept) >= self.max_frames - 1:  # full: halve the kept steps, double the stride
            self._kept = self._kept[::2]
            self.stride *= 2
            if index % self.stride:
                return False
        self._kept.append(rec)
        return True

    def finish(self, success: bool, steps: int, end: str = "") -> None:
        """The episode's result, drawn on the last frame."""
        self.result = (bool(success), int(steps), str(end))

    @property
    def frame_count(self) -> int:
        """Frames the GIF will have (<= max_frames)."""
        return len(self._steps())

    @property
    def kept_steps(self) -> list[int]:
        """The step numbers of the frames the GIF will have, in order."""
        return [s.step for s in self._steps()]

    def _steps(self) -> list[VideoStep]:
        steps = list(self._kept)
        if self._last is not None and (not steps or steps[-1] is not self._last):
            steps.append(self._last)
        return steps

    # ---- composing -------------------------------------------------------------------------------------
    def result_text(self) -> str:
        if self.result is None:
            last = self._last.step if self._last is not None else 0
            return f"STOPPED at step {last} (episode unfinished)  {self.task}"
        success, steps, end = self.result
        if success:
            return f"SUCCESS at step {steps}  {self.task}"
        return f"FAILED at step {steps}{f' ({end})' if end else ''}  {self.task}"

    def render_frames(self, min_width: int = DEFAULT_MIN_WIDTH) -> list[np.ndarray]:
        """The composed RGB frames (uint8, all of one size: ``layout_for(frame_hw, min_width)``)."""
        steps = self._steps()
        if not steps:
            raise ValueError("no frames recorded: nothing to compose")
        lay = layout_for(steps[0].frame.shape[:2], min_width)
        font = _font(lay.font_px)
        return [self._compose(s, lay, font, last=(i == len(steps) - 1)) for i, s in enumerate(steps)]

    def _compose(self, s: VideoStep, lay: Layout, font, last: bool) -> np.ndarray:
        from PIL import Image, ImageDraw

        out = np.empty((lay.height, lay.width, 3), np.uint8)
        ck = colour_kind(s.kind)
        out[:lay.banner_h] = KIND_COLOURS[ck]
        out[lay.image_top:lay.strip_top] = np.repeat(np.repeat(s.frame, lay.scale, axis=0), lay.scale, axis=1)
        if last:
            strip_bg, strip_fg = self._result_colours()
            strip_text = self.result_text()
        else:
            strip_bg, strip_fg, strip_text = STRIP_COLOUR, WHITE, _action_text(s)
        out[lay.strip_top:] = strip_bg
        label = s.kind.upper() if s.kind in KINDS else f"SIM HOLD ({s.kind})"
        of = f"/{self.horizon}" if self.horizon else ""
        img = Image.fromarray(out)
        draw = ImageDraw.Draw(img)
        draw.text((lay.pad, lay.pad), f"{label}  step {s.step}{of}", fill=TEXT_ON[ck], font=font)
        draw.text((lay.pad, lay.strip_top + lay.pad), strip_text, fill=strip_fg, font=font)
        arr = np.asarray(img).copy()
        # the right-hand margin never carries text (a long line is clipped there), so the banner colour can be
        # read at a known place
        arr[:lay.banner_h, lay.width - lay.pad:] = KIND_COLOURS[ck]
        arr[lay.strip_top:, lay.width - lay.pad:] = strip_bg
        return arr

    def _result_colours(self) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        if self.result is None:
            return STOPPED_COLOUR, WHITE
        return (KIND_COLOURS["fresh"], BLACK) if self.result[0] else (KIND_COLOURS["hold"], WHITE)

    def durations_ms(self, end_hold_ms: int = 2000) -> list[int]:
        """GIF frame durations: ``stride`` control periods each (real time), the last frame ``end_hold_ms``."""
        n = self.frame_count
        period = max(MIN_FRAME_MS, int(round(1000.0 * self.stride / self.control_hz)))
        return [period] * (n - 1) + [max(MIN_FRAME_MS, int(end_hold_ms))] if n else []

    # ---- writing -------------------------------------------------------------------------------------
    def write_gif(self, path: str | os.PathLike, min_width: int = DEFAULT_MIN_WIDTH,
                  end_hold_ms: int = 2000) -> dict:
        """Write the GIF (atomically: a temporary file renamed); returns {path, frames, bytes, width, height}."""
        try:
            from PIL import Image
        except ImportError as exc:  # Pillow is in the data / train extras, not the sim extra
            raise RuntimeError("writing an episode GIF needs Pillow (pip install Pillow)") from exc
        frames = self.render_frames(min_width)
        palette = _shared_palette(frames)
        images = [Image.fromarray(f).quantize(palette=palette, dither=Image.Dither.NONE) for f in frames]
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        images[0].save(tmp, format="GIF", save_all=True, append_images=images[1:],
                       duration=self.durations_ms(end_hold_ms), loop=0, optimize=False)
        os.replace(tmp, path)
        h, w = frames[0].shape[:2]
        return {"path": str(path), "frames": len(frames), "bytes": path.stat().st_size, "width": w, "height": h,
                "steps_seen": self.steps_seen, "stride": self.stride}


def _action_text(s: VideoStep) -> str:
    if s.action is None:
        return "zero motion, gripper unchanged"
    a = s.action
    return (f"dx {a[X] * 1e3:+.1f} dy {a[Y] * 1e3:+.1f} dz {a[Z] * 1e3:+.1f} mm  grip {a[GRIPPER]:.2f}")


def _font(px: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=px)  # scalable (Pillow >= 10.1 with FreeType)
    except (TypeError, ValueError, OSError, ImportError):
        return ImageFont.load_default()  # the fixed bitmap font


def _shared_palette(frames: Sequence[np.ndarray], samples: int = 8):
    """A P-mode palette image: FIXED_PALETTE first (exact), then an adaptive palette of up to ``samples``
    evenly spaced frames."""
    from PIL import Image

    idx = np.unique(np.linspace(0, len(frames) - 1, min(samples, len(frames))).round().astype(int))
    mosaic = Image.fromarray(np.concatenate([frames[i] for i in idx], axis=0))
    free = 256 - len(FIXED_PALETTE)
    adaptive = mosaic.quantize(colors=free, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    rgb = np.array((adaptive.getpalette() or [])[: 3 * free], np.int32).reshape(-1, 3)
    fixed = np.array(FIXED_PALETTE, np.int32)
    # Pillow maps colours to a palette through a cache of 4-level boxes: an adaptive entry within a few levels
    # of a fixed colour could take the fixed colour's pixels, so such entries are dropped
    near = (np.abs(rgb[:, None, :] - fixed[None, :, :]).max(axis=2) <= NEAR_FIXED).any(axis=1)
    flat = fixed.ravel().tolist() + rgb[~near].ravel().tolist()
    flat += [0] * (768 - len(flat))
    pal = Image.new("P", (1, 1))
    pal.putpalette(flat)
    return pal
