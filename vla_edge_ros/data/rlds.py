"""RLDS dataset directories (TFDS layout) read and written without TensorFlow.

A directory holds ``dataset_info.json`` (name, version, splits with shard lengths and a file-name template),
``features.json`` (the TFDS feature tree) and TFRecord shards. One record is one episode, a serialized
``tf.train.Example`` whose step features are flattened as ``steps/<path>`` with the T step values concatenated;
episode-level features sit at their own path (``episode_metadata/...``). This module reads the feature tree,
reshapes every step feature to ``(T, *shape)`` and yields :class:`Episode` objects; encoded images and strings
stay per-step ``bytes``/``str`` lists.

:func:`write_rlds_dataset` writes the same layout (used for test fixtures and synthetic clips).
"""
from __future__ import annotations

import glob
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import numpy as np

from .tfrecord import RecordIssue, encode_example, iter_examples, write_records

STEPS = "steps"


class RLDSError(ValueError):
    """The directory is not a readable RLDS dataset (missing/invalid metadata, no shards, bad features)."""


@dataclass(frozen=True)
class FeatureSpec:
    key: str  # flattened path inside the Example, e.g. "steps/observation/image_0"
    kind: str  # "tensor" | "image" | "text"
    dtype: str  # numpy-style dtype name; "string" for text/bytes
    shape: tuple[int, ...]  # per-step (or per-episode) shape; -1 for a variable dimension
    encoding: str = "none"  # tensors: none | bytes | zlib; images: jpeg | png
    in_steps: bool = False

    @property
    def step_key(self) -> str:
        """The key relative to ``steps/`` (what mappings use), or the full key for episode-level features."""
        prefix = STEPS + "/"
        return self.key[len(prefix):] if self.key.startswith(prefix) else self.key

    def to_json(self) -> dict:
        dims = {"dimensions": [str(d) for d in self.shape]} if self.shape else {}
        if self.kind == "image":
            return {"pythonClassName": "tensorflow_datasets.core.features.image_feature.Image",
                    "image": {"shape": dims, "dtype": self.dtype, "encodingFormat": self.encoding}}
        if self.kind == "text":
            return {"pythonClassName": "tensorflow_datasets.core.features.text_feature.Text", "text": {}}
        cls = "scalar.Scalar" if not self.shape else "tensor_feature.Tensor"
        return {"pythonClassName": f"tensorflow_datasets.core.features.{cls}",
                "tensor": {"shape": dims, "dtype": self.dtype, "encoding": self.encoding}}


@dataclass
class Episode:
    index: int  # running index over the episodes read (corrupt records do not take an index)
    shard: str
    offset: int  # byte offset of the record in the shard
    num_steps: int
    steps: dict[str, object]  # step key (no "steps/" prefix) -> ndarray (T, ...) | list[bytes] | list[str]
    metadata: dict[str, object] = field(default_factory=dict)  # episode-level features by full key


# ---------------------------------------------------------------------------------------------------------------
# features.json
# ---------------------------------------------------------------------------------------------------------------

def _shape(node: Mapping) -> tuple[int, ...]:
    dims = (node.get("shape") or {}).get("dimensions") or []
    out = []
    for d in dims:
        try:
            out.append(int(d))
        except (TypeError, ValueError):
            out.append(-1)
    return tuple(out)


def parse_features(tree: Mapping) -> list[FeatureSpec]:
    """Flatten a TFDS features.json tree into leaf specs."""
    specs: list[FeatureSpec] = []

    def walk(node: Mapping, path: str, in_steps: bool) -> None:
        if not isinstance(node, Mapping):
            raise RLDSError(f"features.json: node {path or '<root>'} is not an object")
        if "featuresDict" in node:
            for name, child in (node["featuresDict"].get("features") or {}).items():
                walk(child, f"{path}/{name}" if path else name, in_steps)
        elif "sequence" in node:
            walk(node["sequence"].get("feature") or {}, path, True)
        elif "tensor" in node:
            t = node["tensor"]
            dtype = t.get("dtype", "float32")
            kind = "text" if dtype == "string" else "tensor"
            specs.append(FeatureSpec(path, kind, dtype, _shape(t), t.get("encoding", "none") or "none", in_steps))
        elif "image" in node:
            im = node["image"]
            specs.append(FeatureSpec(path, "image", im.get("dtype", "uint8"), _shape(im),
                                     (im.get("encodingFormat") or "png").lower(), in_steps))
        elif "text" in node:
            specs.append(FeatureSpec(path, "text", "string", (), "none", in_steps))
        elif "classLabel" in node:
            specs.append(FeatureSpec(path, "tensor", "int64", (), "none", in_steps))
        else:
            cls = node.get("pythonClassName", "?")
            raise RLDSError(f"features.json: unsupported feature {path or '<root>'} ({cls})")

    walk(tree, "", False)
    return specs


def features_tree(specs: Sequence[FeatureSpec]) -> dict:
    """Inverse of parse_features for specs whose step features all live under ``steps/``."""
    root: dict = {}
    steps: dict = {}
    for s in specs:
        parts = s.key.split("/")
        if s.in_steps:
            if parts[0] != STEPS:
                raise ValueError(f"step feature {s.key} must start with 'steps/'")
            target, parts = steps, parts[1:]
        else:
            target = root
        for p in parts[:-1]:
            target = target.setdefault(p, {})
        target[parts[-1]] = s

    def to_json(d: dict) -> dict:
        return {"pythonClassName": "tensorflow_datasets.core.features.features_dict.FeaturesDict",
                "featuresDict": {"features": {k: (v.to_json() if isinstance(v, FeatureSpec) else to_json(v))
                                              for k, v in d.items()}}}

    tree = to_json(root)
    if steps:
        tree["featuresDict"]["features"][STEPS] = {
            "pythonClassName": "tensorflow_datasets.core.features.dataset_feature.Dataset",
            "sequence": {"feature": to_json(steps), "length": "-1"}}
    return tree


# ---------------------------------------------------------------------------------------------------------------
# decoding one episode
# ---------------------------------------------------------------------------------------------------------------

_NUMPY_DTYPES = {"bool": np.bool_, "float16": np.float16, "bfloat16": np.float32, "float32": np.float32,
                 "float64": np.float64, "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
                 "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64}


def _np_dtype(spec: FeatureSpec):
    try:
        return _NUMPY_DTYPES[spec.dtype]
    except KeyError:
        raise RLDSError(f"feature {spec.key}: unsupported dtype {spec.dtype}") from None


def _decode_value(spec: FeatureSpec, raw, steps: int | None):
    """Turn one decoded Example feature into its array/list; ``steps`` None for episode-level features."""
    if spec.kind == "image":
        return list(raw) if isinstance(raw, list) else []
    if spec.kind == "text":
        if not isinstance(raw, list):
            raise RLDSError(f"feature {spec.key}: expected a bytes list for text, got numbers")
        return [b.decode("utf-8", errors="replace") for b in raw]
    dtype = _np_dtype(spec)
    if spec.encoding in ("bytes", "zlib"):
        if not isinstance(raw, list):
            raise RLDSError(f"feature {spec.key}: encoding={spec.encoding} expects bytes")
        import zlib

        arrays = [np.frombuffer(zlib.decompress(b) if spec.encoding == "zlib" else b, dtype=dtype)
                  for b in raw]
        elems = [a.reshape(spec.shape) if -1 not in spec.shape else a for a in arrays]
        return np.stack(elems) if steps is not None else (elems[0] if elems else np.zeros(spec.shape, dtype))
    if isinstance(raw, list):
        if raw:
            raise RLDSError(f"feature {spec.key}: expected numbers, found bytes")
        raw = np.zeros(0, dtype=dtype)
    arr = np.asarray(raw).astype(dtype, copy=False)
    if steps is None:
        return arr.reshape(spec.shape) if -1 not in spec.shape and arr.size == math.prod(spec.shape) else arr
    per_step = math.prod(spec.shape) if -1 not in spec.shape else None
    if per_step is None:
        if steps == 0 or arr.size % steps:
            raise RLDSError(f"feature {spec.key}: {arr.size} values do not split into {steps} steps")
        return arr.reshape(steps, -1)
    if arr.size != steps * per_step:
        raise RLDSError(f"feature {spec.key}: {arr.size} values, expected {steps} steps x {per_step} "
                        f"(shape {spec.shape})")
    return arr.reshape((steps,) + spec.shape)


def _episode_length(specs: Sequence[FeatureSpec], ex: Mapping[str, object]) -> int:
    """T from the per-step features: counted bytes lists, else numbers divided by the per-step size."""
    counts: dict[str, int] = {}
    for s in specs:
        if not s.in_steps or s.key not in ex:
            continue
        raw = ex[s.key]
        if isinstance(raw, list) and (s.kind in ("image", "text") or s.encoding != "none"):
            counts[s.key] = len(raw)
        elif not isinstance(raw, list) and -1 not in s.shape:
            per = math.prod(s.shape)
            if per:
                if raw.size % per:
                    raise RLDSError(f"feature {s.key}: {raw.size} values are not a multiple of shape {s.shape}")
                counts[s.key] = raw.size // per
    if not counts:
        raise RLDSError("episode has no step features")
    lengths = set(counts.values())
    if len(lengths) != 1:
        detail = ", ".join(f"{k}={v}" for k, v in sorted(counts.items()))
        raise RLDSError(f"step features disagree on the episode length: {detail}")
    return lengths.pop()


def decode_episode(specs: Sequence[FeatureSpec], ex: Mapping[str, object]) -> tuple[int, dict, dict]:
    steps_n = _episode_length(specs, ex)
    steps: dict[str, object] = {}
    meta: dict[str, object] = {}
    for s in specs:
        if s.key not in ex:
            continue
        if s.in_steps:
            steps[s.step_key] = _decode_value(s, ex[s.key], steps_n)
        else:
            meta[s.key] = _decode_value(s, ex[s.key], None)
    return steps_n, steps, meta


# ---------------------------------------------------------------------------------------------------------------
# the dataset directory
# ---------------------------------------------------------------------------------------------------------------

def find_dataset_dir(path: str | os.PathLike) -> Path:
    """The directory holding dataset_info.json: ``path`` itself, or a unique one up to two levels below."""
    root = Path(path)
    if not root.exists():
        raise RLDSError(f"{root}: no such directory")
    if (root / "dataset_info.json").is_file():
        return root
    found = sorted({Path(p).parent for pat in ("*/dataset_info.json", "*/*/dataset_info.json")
                    for p in glob.glob(str(root / pat))})
    if len(found) == 1:
        return found[0]
    if not found:
        raise RLDSError(f"{root}: no dataset_info.json here or in the two levels below; an RLDS dataset "
                        f"directory holds dataset_info.json, features.json and *.tfrecord-* shards")
    raise RLDSError(f"{root}: several datasets below, pass one of: " + ", ".join(map(str, found)))


class RLDSDataset:
    def __init__(self, path: str | os.PathLike):
        self.root = find_dataset_dir(path)
        info_path, feat_path = self.root / "dataset_info.json", self.root / "features.json"
        if not feat_path.is_file():
            raise RLDSError(f"{self.root}: features.json is missing (needed for feature shapes and dtypes)")
        try:
            self.info = json.loads(info_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise RLDSError(f"{info_path}: not readable JSON: {exc}") from exc
        try:
            tree = json.loads(feat_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise RLDSError(f"{feat_path}: not readable JSON: {exc}") from exc
        self.name: str = self.info.get("name") or self.root.parent.name
        self.version: str = str(self.info.get("version") or self.root.name)
        self.features = parse_features(tree)
        if not any(s.in_steps for s in self.features):
            raise RLDSError(f"{feat_path}: no 'steps' sequence feature; not an RLDS dataset")
        self.by_key = {s.key: s for s in self.features}
        self.step_specs = {s.step_key: s for s in self.features if s.in_steps}
        self.splits = {s["name"]: s for s in self.info.get("splits", []) if "name" in s}

    @property
    def step_keys(self) -> list[str]:
        return sorted(self.step_specs)

    def default_split(self) -> str | None:
        if "train" in self.splits:
            return "train"
        return next(iter(self.splits), None)

    def shard_paths(self, split: str | None = None, issues: list[RecordIssue] | None = None) -> list[Path]:
        """Shards of ``split`` (default: train) from dataset_info.json, else every *.tfrecord* file."""
        split = split or self.default_split()
        file_format = self.info.get("fileFormat", "tfrecord")
        if split is not None and split in self.splits:
            entry = self.splits[split]
            n = len(entry.get("shardLengths") or [])
            template = entry.get("filepathTemplate") or "{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}"
            expected = [self.root / template.replace("{DATASET}", self.name).replace("{SPLIT}", split)
                        .replace("{FILEFORMAT}", file_format).replace("{SHARD_X_OF_Y}", f"{i:05d}-of-{n:05d}")
                        for i in range(n)]
            present = [p for p in expected if p.is_file()]
            for p in expected:
                if not p.is_file() and issues is not None:
                    issues.append(RecordIssue(str(p), 0, "missing_shard", "shard listed in dataset_info.json "
                                              "is not on disk"))
            if present:
                return present
            if n:
                raise RLDSError(f"{self.root}: none of the {n} shard(s) of split {split!r} exist "
                                f"(expected e.g. {expected[0].name})")
        elif split is not None and self.splits:
            raise RLDSError(f"{self.root}: no split {split!r}; splits: {', '.join(self.splits)}")
        found = sorted(p for p in self.root.glob(f"*.{file_format}*") if p.is_file())
        if not found:
            raise RLDSError(f"{self.root}: no *.{file_format}* shard files")
        return found

    def episodes(self, split: str | None = None, limit: int | None = None,
                 issues: list[RecordIssue] | None = None) -> Iterator[Episode]:
        """Episodes in shard order; damaged records/episodes go to ``issues`` and are skipped."""
        sink: list[RecordIssue] = issues if issues is not None else []
        index = 0
        for shard in self.shard_paths(split, sink):
            for offset, ex in iter_examples(shard, sink):
                if limit is not None and index >= limit:
                    return
                try:
                    n, steps, meta = decode_episode(self.features, ex)
                except RLDSError as exc:
                    sink.append(RecordIssue(str(shard), offset, "decode", str(exc)))
                    continue
                yield Episode(index, str(shard), offset, n, steps, meta)
                index += 1


# ---------------------------------------------------------------------------------------------------------------
# writing (fixtures, synthetic clips)
# ---------------------------------------------------------------------------------------------------------------

def encode_episode(specs: Sequence[FeatureSpec], steps: Mapping[str, object],
                   metadata: Mapping[str, object] | None = None) -> dict[str, object]:
    """{step key: (T, ...) array | list of bytes/str} -> flat Example features (``steps/`` prefixed)."""
    out: dict[str, object] = {}
    for s in specs:
        src = steps if s.in_steps else (metadata or {})
        name = s.step_key if s.in_steps else s.key
        if name not in src:
            continue
        v = src[name]
        if s.kind in ("image", "text"):
            out[s.key] = [x.encode("utf-8") if isinstance(x, str) else bytes(x) for x in
                          (v if isinstance(v, (list, tuple)) else [v])]
        elif s.encoding == "bytes":
            arr = np.asarray(v, dtype=_np_dtype(s))
            out[s.key] = [a.tobytes() for a in arr] if s.in_steps else [arr.tobytes()]
        else:
            arr = np.asarray(v)
            out[s.key] = arr.astype(np.int64) if arr.dtype.kind in "biu" else arr.astype(np.float32)
    return out


def write_rlds_dataset(root: str | os.PathLike, name: str, version: str, specs: Sequence[FeatureSpec],
                       episodes: Sequence[Mapping[str, object]], split: str = "train", shards: int = 1,
                       metadata: Sequence[Mapping[str, object]] | None = None, packed: bool = True) -> Path:
    """Write ``root/name/version/`` in the TFDS layout; ``episodes`` are {step key: values} dicts."""
    out_dir = Path(root) / name / version
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "features.json").write_text(json.dumps(features_tree(specs), indent=2))
    shards = max(1, min(shards, len(episodes) or 1))
    per = [list(range(len(episodes)))[i::shards] for i in range(shards)]
    total = 0
    for i, idxs in enumerate(per):
        payloads = [encode_example(encode_episode(specs, episodes[j], metadata[j] if metadata else None), packed)
                    for j in idxs]
        path = out_dir / f"{name}-{split}.tfrecord-{i:05d}-of-{shards:05d}"
        write_records(path, payloads)
        total += path.stat().st_size
    info = {"name": name, "version": version, "fileFormat": "tfrecord",
            "moduleName": "vla_edge_ros.data.rlds (synthetic)",
            "splits": [{"name": split, "filepathTemplate": "{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}",
                        "numBytes": str(total), "shardLengths": [str(len(p)) for p in per]}]}
    (out_dir / "dataset_info.json").write_text(json.dumps(info, indent=2))
    return out_dir


# ---------------------------------------------------------------------------------------------------------------
# synthetic datasets (tests, and a clip for the benchmark when no real data is around)
# ---------------------------------------------------------------------------------------------------------------

SYNTHETIC_LAYOUTS = ("bridge_dataset", "fractal20220817_data")


def synthetic_specs(layout: str, image_hw: tuple[int, int] = (64, 64)) -> tuple[str, str, list[FeatureSpec]]:
    """(name, version, specs) of a small dataset laid out like ``layout`` (flat or nested action)."""
    h, w = image_hw
    if layout == "bridge_dataset":
        return "bridge_dataset", "1.0.0", [
            FeatureSpec("steps/observation/image_0", "image", "uint8", (h, w, 3), "jpeg", True),
            FeatureSpec("steps/observation/state", "tensor", "float32", (7,), "none", True),
            FeatureSpec("steps/action", "tensor", "float32", (7,), "none", True),
            FeatureSpec("steps/language_instruction", "text", "string", (), "none", True),
            FeatureSpec("steps/is_first", "tensor", "bool", (), "none", True),
            FeatureSpec("steps/is_last", "tensor", "bool", (), "none", True),
            FeatureSpec("steps/reward", "tensor", "float32", (), "none", True),
            FeatureSpec("episode_metadata/episode_id", "tensor", "int32", (), "none", False),
        ]
    if layout == "fractal20220817_data":
        return "fractal20220817_data", "0.1.0", [
            FeatureSpec("steps/observation/image", "image", "uint8", (h, w, 3), "jpeg", True),
            FeatureSpec("steps/observation/natural_language_instruction", "text", "string", (), "none", True),
            FeatureSpec("steps/action/world_vector", "tensor", "float32", (3,), "none", True),
            FeatureSpec("steps/action/rotation_delta", "tensor", "float32", (3,), "none", True),
            FeatureSpec("steps/action/gripper_closedness_action", "tensor", "float32", (1,), "none", True),
            FeatureSpec("steps/action/terminate_episode", "tensor", "int32", (3,), "none", True),
            FeatureSpec("steps/is_first", "tensor", "bool", (), "none", True),
            FeatureSpec("steps/is_last", "tensor", "bool", (), "none", True),
        ]
    raise ValueError(f"unknown synthetic layout {layout!r}; choose from {', '.join(SYNTHETIC_LAYOUTS)}")


def synthetic_action(episode: int, steps: int) -> np.ndarray:
    """(T, 7) actions in the runtime convention (gripper 1 open, closes at T//2): known values for tests."""
    t = np.arange(steps, dtype=np.float32)[:, None]
    a = np.concatenate([0.01 * (t + 1) * (np.arange(6, dtype=np.float32) + 1) * (1 if episode % 2 == 0 else -1),
                        (t < steps // 2).astype(np.float32)], axis=1)
    return a.astype(np.float32)


def _synthetic_frame(episode: int, step: int, steps: int, hw: tuple[int, int]) -> np.ndarray:
    """A textured scene with a moving square; the background changes at T//2 (a salient scene change)."""
    h, w = hw
    yy, xx = np.mgrid[0:h, 0:w]
    phase = 0 if step < steps // 2 else 1
    img = np.stack([(xx * 4 + episode * 40 + phase * 120) % 256, (yy * 4 + phase * 90) % 256,
                    ((xx + yy) * 2 + episode * 17) % 256], axis=2).astype(np.uint8)
    s = max(4, h // 6)
    y0 = (step * 3) % max(1, h - s)
    x0 = (step * 5 + episode * 7) % max(1, w - s)
    img[y0:y0 + s, x0:x0 + s] = (255, 255, 255)
    return img


def write_synthetic_dataset(root: str | os.PathLike, layout: str = "bridge_dataset", episodes: int = 3,
                            steps: int = 8, image_hw: tuple[int, int] = (64, 64), shards: int = 1) -> Path:
    """A small RLDS dataset in ``layout`` with JPEG frames and :func:`synthetic_action` actions."""
    from io import BytesIO

    from PIL import Image as PILImage

    name, version, specs = synthetic_specs(layout, image_hw)
    eps, metas = [], []
    for e in range(episodes):
        jpegs = []
        for i in range(steps):
            buf = BytesIO()
            PILImage.fromarray(_synthetic_frame(e, i, steps, image_hw)).save(buf, format="JPEG", quality=90)
            jpegs.append(buf.getvalue())
        act = synthetic_action(e, steps)
        instruction = f"synthetic task {e % 2}: move the block"
        first = np.arange(steps) == 0
        last = np.arange(steps) == steps - 1
        if layout == "bridge_dataset":
            eps.append({"observation/image_0": jpegs, "observation/state": np.zeros((steps, 7), np.float32),
                        "action": act, "language_instruction": [instruction] * steps, "is_first": first,
                        "is_last": last, "reward": last.astype(np.float32)})
            metas.append({"episode_metadata/episode_id": np.int32(e)})
        else:
            closedness = (1.0 - 2.0 * act[:, 6:7]).astype(np.float32)  # open (1) -> -1, closed (0) -> +1
            eps.append({"observation/image": jpegs, "observation/natural_language_instruction": [instruction] * steps,
                        "action/world_vector": act[:, 0:3], "action/rotation_delta": act[:, 3:6],
                        "action/gripper_closedness_action": closedness,
                        "action/terminate_episode": np.zeros((steps, 3), np.int32),
                        "is_first": first, "is_last": last})
            metas.append({})
    return write_rlds_dataset(root, name, version, specs, eps, shards=shards, metadata=metas)
