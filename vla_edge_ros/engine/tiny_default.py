"""The embedded default model: a tiny Qwen2-geometry checkpoint generated deterministically on first use.

Geometry: ``config.tiny_default_dict()`` (hidden 256, 2 layers, 4 heads, 2 KV heads, intermediate 704,
vocabulary 512 = 256 byte tokens + 256 action bins). Weights: ``numpy.random.default_rng(SEED)`` draws every
tensor in sorted-name order (normal, std 0.02 for matrices and biases, std 0.05 for the vision projection and
position embedding so frames differ visibly; norms are ones), written as bfloat16 safetensors + config.json.
The normal loader then reads it, so the default path exercises the real checkpoint code.

Location: ``$VLA_EDGE_ROS_CACHE/tiny-default-v2`` (default ``~/.cache/vla_edge_ros/tiny-default-v2``).
Written into a temporary sibling directory and renamed into place, so a crash or a concurrent first use never
leaves a half-written default; a manifest holds the SHA-256 of the weights, and a cache whose weights do not
match it is regenerated.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from vla_edge_ros.engine.checkpoint import SINGLE_NAME, expected_shapes, write_checkpoint
from vla_edge_ros.engine.config import ModelConfig, tiny_default_dict

NAME = "tiny-default-v2"
SEED = 20240611
MANIFEST = "manifest.json"


def default_cache_root() -> Path:
    env = os.environ.get("VLA_EDGE_ROS_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vla_edge_ros"


def tiny_default_tensors() -> dict[str, np.ndarray]:
    cfg = ModelConfig.from_json(tiny_default_dict())
    shapes = expected_shapes(cfg, include_vision=True)
    rng = np.random.default_rng(SEED)
    out: dict[str, np.ndarray] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            out[name] = np.ones(shape, np.float32)
        elif name.startswith("vision."):
            out[name] = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        else:
            out[name] = (rng.standard_normal(shape) * 0.02).astype(np.float32)
    return out


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _is_complete(d: Path) -> bool:
    try:
        manifest = json.loads((d / MANIFEST).read_text(encoding="utf-8"))
        return (d / "config.json").is_file() and manifest.get("sha256") == sha256_of(d / SINGLE_NAME)
    except (OSError, ValueError):
        return False


def ensure_tiny_default(cache_dir: str | Path | None = None) -> Path:
    """Return the directory of the tiny default checkpoint, generating it first when absent or damaged.

    ``cache_dir`` is the root that holds ``tiny-default-v2`` (default: ``default_cache_root()``).
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    final = root / NAME
    if _is_complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{NAME}.tmp-", dir=root))
    try:
        write_checkpoint(tmp, tiny_default_dict(), tiny_default_tensors(), dtype="bfloat16", shards=1)
        manifest = {"name": NAME, "seed": SEED, "sha256": sha256_of(tmp / SINGLE_NAME)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        if final.exists() and not _is_complete(final):
            # damaged earlier copy (ours to manage): move it aside, then remove it
            stale = Path(tempfile.mkdtemp(prefix=f".{NAME}.stale-", dir=root))
            os.replace(final, stale / NAME)
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not _is_complete(final):  # lost a race against a writer that did not finish: give up clearly
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
