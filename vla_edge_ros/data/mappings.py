"""How each Open X-Embodiment dataset maps onto the runtime's view: camera image(s), instruction, a 7-dim action
(end-effector deltas of x, y, z, roll, pitch, yaw, then the gripper with 1 = open / 0 = closed), and the native
control rate. The dimensions carry the runtime's own names (ACTION_NAMES is the engine's DEFAULT_ACTION_NAMES,
which /vla/action publishes unless a checkpoint's "vla" block names them otherwise), so a recorded action and a
predicted one name each value the same way.

Keys are step keys (relative to ``steps/``), as in the dataset's features.json. An action is assembled by
concatenating the listed parts (``key`` or ``key[a:b]`` for a slice of the last axis) and must come out 7 wide;
the last dimension is then converted to the open=1/closed=0 convention by the mapping's gripper transform.

A dataset name may have several layouts (the OXE bucket copy of ``bridge`` nests the action as a dict, the
TFDS-catalog copy stores a flat 7-vector): :func:`mapping_for` picks the first layout whose keys all exist in
the dataset's features.json, and otherwise says which keys each layout is missing.

Schemas: TFDS catalog (tensorflow.org/datasets/catalog/<name>) and the OXE dataset spreadsheet.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from vla_edge_ros.engine.config import DEFAULT_ACTION_NAMES

ACTION_NAMES = DEFAULT_ACTION_NAMES  # one naming for recorded and predicted actions (x y z roll pitch yaw gripper)
ACTION_DIMS = len(ACTION_NAMES)


class MappingError(ValueError):
    """No usable mapping for a dataset, or a mapping that does not fit the dataset's features."""


def _open01(g: np.ndarray) -> np.ndarray:
    return g.astype(np.float32)


def _open_pm1(g: np.ndarray) -> np.ndarray:  # +1 open, -1 closed
    return ((g.astype(np.float32) + 1.0) * 0.5).astype(np.float32)


def _close_pm1(g: np.ndarray) -> np.ndarray:  # +1 close, -1 open (RT-1 gripper_closedness_action, TACO)
    return ((1.0 - g.astype(np.float32)) * 0.5).astype(np.float32)


def _close01(g: np.ndarray) -> np.ndarray:  # 1 closed, 0 open
    return (1.0 - g.astype(np.float32)).astype(np.float32)


GRIPPER_TRANSFORMS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "open01": _open01,  # already 1 = open, 0 = closed (Bridge), also bool open_gripper
    "open_pm1": _open_pm1,
    "close_pm1": _close_pm1,
    "close01": _close01,
}

_PART_RE = re.compile(r"^(?P<key>[^\[\]]+?)(?:\[(?P<a>-?\d*):(?P<b>-?\d*)\])?$")


@dataclass(frozen=True)
class ActionPart:
    key: str
    start: int | None = None
    stop: int | None = None

    @classmethod
    def parse(cls, text: str) -> "ActionPart":
        m = _PART_RE.match(text.strip())
        if not m:
            raise MappingError(f"bad action part {text!r}: use KEY or KEY[a:b]")
        a, b = m.group("a"), m.group("b")
        return cls(m.group("key").strip(), int(a) if a else None, int(b) if b else None)

    def __str__(self) -> str:
        if self.start is None and self.stop is None:
            return self.key
        return f"{self.key}[{'' if self.start is None else self.start}:{'' if self.stop is None else self.stop}]"


@dataclass(frozen=True)
class DatasetMapping:
    dataset: str
    version: str
    image_keys: tuple[str, ...]  # first = the runtime's camera
    instruction_key: str | None  # per-step string feature; None -> no instruction in the data
    action_parts: tuple[ActionPart, ...]
    gripper: str  # key of GRIPPER_TRANSFORMS
    rate_hz: float
    layout: str = ""  # which copy of the dataset this layout describes

    def __post_init__(self):
        if self.gripper not in GRIPPER_TRANSFORMS:
            raise MappingError(f"unknown gripper transform {self.gripper!r}; "
                               f"choose from {', '.join(GRIPPER_TRANSFORMS)}")
        if not self.image_keys:
            raise MappingError("a mapping needs at least one image key")
        if not (self.rate_hz > 0):
            raise MappingError(f"rate_hz must be > 0, got {self.rate_hz}")

    @property
    def required_keys(self) -> list[str]:
        keys = list(self.image_keys) + [p.key for p in self.action_parts]
        if self.instruction_key:
            keys.append(self.instruction_key)
        return keys

    def missing_keys(self, available: Iterable[str]) -> list[str]:
        have = set(available)
        return [k for k in self.required_keys if k not in have]

    def action(self, steps: Mapping[str, object]) -> np.ndarray:
        """(T, 7) float32 in the runtime's convention."""
        cols = []
        for part in self.action_parts:
            if part.key not in steps:
                raise MappingError(f"action part {part.key!r} not in the episode")
            arr = np.asarray(steps[part.key])
            if arr.dtype.kind not in "biuf":
                raise MappingError(f"action part {part.key!r} is not numeric ({arr.dtype})")
            arr = arr.reshape(arr.shape[0], -1)[:, part.start:part.stop].astype(np.float32)
            cols.append(arr)
        action = np.concatenate(cols, axis=1) if cols else np.zeros((0, 0), np.float32)
        if action.shape[1] != ACTION_DIMS:
            widths = ", ".join(f"{p}={c.shape[1]}" for p, c in zip(self.action_parts, cols))
            raise MappingError(f"{self.dataset}: action parts give {action.shape[1]} dims ({widths}), "
                               f"need {ACTION_DIMS} ({', '.join(ACTION_NAMES)})")
        action[:, -1] = GRIPPER_TRANSFORMS[self.gripper](action[:, -1])
        return action

    def instructions(self, steps: Mapping[str, object], num_steps: int) -> list[str]:
        if not self.instruction_key:
            return [""] * num_steps
        raw = steps.get(self.instruction_key)
        if raw is None:
            raise MappingError(f"instruction key {self.instruction_key!r} not in the episode")
        return [x if isinstance(x, str) else bytes(x).decode("utf-8", "replace") for x in raw]  # type: ignore

    def describe(self) -> str:
        return (f"{self.dataset} {self.version}{' (' + self.layout + ')' if self.layout else ''}: images "
                f"{', '.join(self.image_keys)}; instruction {self.instruction_key}; action "
                f"{' + '.join(map(str, self.action_parts))} (gripper {self.gripper}); {self.rate_hz:g} Hz")


def _m(dataset, version, images, instruction, parts, gripper, rate, layout=""):
    return DatasetMapping(dataset, version, tuple(images), instruction, tuple(ActionPart.parse(p) for p in parts),
                          gripper, float(rate), layout)


MAPPINGS: dict[tuple[str, str], tuple[DatasetMapping, ...]] = {
    # BridgeData V2 as released by its authors (the real sample in shared/data/oxe): flat 7-vector, 5 Hz.
    ("bridge_dataset", "1.0.0"): (
        _m("bridge_dataset", "1.0.0", ["observation/image_0"], "language_instruction", ["action"], "open01", 5.0,
           "authors' RLDS release"),
    ),
    # OXE "bridge": the bucket copy nests the action; the TFDS-catalog copy is laid out like bridge_dataset.
    ("bridge", "0.1.0"): (
        _m("bridge", "0.1.0", ["observation/image"], "observation/natural_language_instruction",
           ["action/world_vector", "action/rotation_delta", "action/open_gripper"], "open01", 5.0,
           "OXE bucket layout"),
        _m("bridge", "0.1.0", ["observation/image_0"], "language_instruction", ["action"], "open01", 5.0,
           "TFDS catalog layout"),
    ),
    # RT-1 (fractal): gripper_closedness_action +1 close / -1 open, 3 Hz.
    ("fractal20220817_data", "0.1.0"): (
        _m("fractal20220817_data", "0.1.0", ["observation/image"], "observation/natural_language_instruction",
           ["action/world_vector", "action/rotation_delta", "action/gripper_closedness_action"], "close_pm1",
           3.0, "OXE layout"),
    ),
    # TACO play: relative world-frame action, last dim -1 open / +1 close, 15 Hz.
    ("taco_play", "0.1.0"): (
        _m("taco_play", "0.1.0", ["observation/rgb_static"], "observation/natural_language_instruction",
           ["action/rel_actions_world"], "close_pm1", 15.0, "OXE layout"),
    ),
}


def known_datasets() -> list[str]:
    return [f"{n} {v}" for n, v in MAPPINGS]


def mapping_for(dataset: str, version: str, available_keys: Iterable[str]) -> DatasetMapping:
    """The first table layout of ``dataset`` (any version when ``version`` is not listed) that fits the keys."""
    have = sorted(set(available_keys))
    candidates = list(MAPPINGS.get((dataset, version), ()))
    if not candidates:
        candidates = [m for (n, _), ms in MAPPINGS.items() if n == dataset for m in ms]
    if not candidates:
        raise MappingError(f"no mapping for dataset {dataset!r} {version}; known: {'; '.join(known_datasets())}. "
                           "Map it from the command line with --image-key, --instruction-key, --action-keys and "
                           f"--rate-hz (step keys available: {', '.join(have)})")
    reasons = []
    for m in candidates:
        missing = m.missing_keys(have)
        if not missing:
            return m
        reasons.append(f"{m.layout or m.version}: missing {', '.join(missing)}")
    raise MappingError(f"dataset {dataset!r} {version}: no known layout fits its features.json ("
                       + "; ".join(reasons) + f"). Step keys available: {', '.join(have)}. Map it from the "
                       "command line with --image-key/--instruction-key/--action-keys/--rate-hz")


def custom_mapping(dataset: str, version: str, image_keys: Sequence[str], instruction_key: str | None,
                   action_keys: str | Sequence[str], rate_hz: float, gripper: str = "open01") -> DatasetMapping:
    """A mapping given on the command line; ``action_keys`` "a/b,c[0:3],..." or a list of parts."""
    parts_text = action_keys.split(",") if isinstance(action_keys, str) else list(action_keys)
    parts = tuple(ActionPart.parse(p) for p in parts_text if p.strip())
    if not parts:
        raise MappingError("--action-keys is empty")
    return DatasetMapping(dataset, version, tuple(image_keys), instruction_key or None, parts, gripper,
                          float(rate_hz), "command line")
