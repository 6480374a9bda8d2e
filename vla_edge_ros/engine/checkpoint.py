"""Safetensors checkpoint loader / writer for HF-layout Qwen2 checkpoints (plus the optional vision tensors).

The safetensors container is parsed here directly (8-byte little-endian header length, JSON header, raw
data) rather than through the ``safetensors`` package, because its numpy API cannot return bfloat16 and
because parsing the header first lets every file be checked (names, shapes, dtypes, offsets, truncation)
before any tensor data is read: a checkpoint is either loaded completely or refused, never half-loaded.

Pickle-based formats (``pytorch_model.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``) are refused, never unpickled.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from vla_edge_ros.engine.config import ModelConfig
from vla_edge_ros.engine.interface import EngineError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
MAX_HEADER_BYTES = 100 * 1024 * 1024

# safetensors dtype tag -> (numpy storage dtype, bytes per element); BF16 is stored as raw uint16
_FLOAT_DTYPES = {"F32": (np.dtype("<f4"), 4), "F16": (np.dtype("<f2"), 2), "BF16": (np.dtype("<u2"), 2),
                 "F64": (np.dtype("<f8"), 8)}
_ALL_DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8,
                    "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}

# Tensors some HF exports carry that are not weights of this model: ignored when present.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

VISION_TENSORS = ("vision.patch_embed.weight", "vision.patch_embed.bias", "vision.pos_embed")


def expected_shapes(cfg: ModelConfig, include_vision: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor the decoder needs, by HF name, with its shape. Vision tensors only when asked."""
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.q_proj.bias": (h,),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, h),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, cfg.intermediate_size),
        })
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    if include_vision:
        shapes.update(vision_shapes(cfg))
    return shapes


def vision_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {"vision.patch_embed.weight": (cfg.hidden_size, cfg.patch_dim),
            "vision.patch_embed.bias": (cfg.hidden_size,),
            "vision.pos_embed": (cfg.n_patches, cfg.hidden_size)}


def _shape_mismatch(name: str, want: tuple[int, ...], found: tuple[int, ...]) -> str:
    return f"tensor {name}: expected shape {list(want)}, found {list(found)}"


def check_weights(cfg: ModelConfig, weights: Mapping[str, Any]) -> None:
    """Every decoder tensor of an in-memory weight mapping (what a backend may be given instead of a checkpoint
    directory) is present with its expected shape; EngineError naming the first that is not. The file-level
    checks of a checkpoint on disk are load_checkpoint's."""
    for name, shape in expected_shapes(cfg).items():
        if name not in weights:
            raise EngineError(f"weights: missing tensor {name}")
        found = tuple(np.shape(weights[name]))
        if found != shape:
            raise EngineError(f"weights: {_shape_mismatch(name, shape, found)}")


# ---------------------------------------------------------------------------------------------------------
# container parsing

@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


def _read_header(path: Path) -> dict[str, _Entry]:
    """Parse and check one .safetensors header; returns name -> entry. Checks offsets against the file size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise EngineError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise EngineError(f"{path}: truncated or not a safetensors file (header claims {n} bytes, "
                                  f"file has {size} bytes)")
            raw = f.read(n)
    except OSError as exc:
        raise EngineError(f"{path}: cannot read ({exc})") from exc
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EngineError(f"{path}: corrupt safetensors header ({exc})") from exc
    if not isinstance(header, dict):
        raise EngineError(f"{path}: corrupt safetensors header (not a JSON object)")
    data_start = 8 + n
    entries: dict[str, _Entry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = info["dtype"]
            shape = tuple(int(x) for x in info["shape"])
            b, e = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineError(f"{path}: tensor {name}: malformed header entry {info!r}") from exc
        if dtype not in _ALL_DTYPE_SIZES:
            raise EngineError(f"{path}: tensor {name}: unknown dtype {dtype!r}")
        nbytes = int(np.prod(shape, dtype=np.int64)) * _ALL_DTYPE_SIZES[dtype]
        if b < 0 or e - b != nbytes:
            raise EngineError(f"{path}: tensor {name}: data_offsets [{b}, {e}] do not match shape {list(shape)} "
                              f"of {dtype} ({nbytes} bytes)")
        if data_start + e > size:
            raise EngineError(f"{path}: truncated file: tensor {name} ends at byte {data_start + e}, "
                              f"the file has only {size} bytes")
        entries[name] = _Entry(path, dtype, shape, data_start + b, data_start + e)
    return entries


def _refuse_pickle(path: Path) -> EngineError:
    return EngineError(f"{path}: pickle-based checkpoint refused (loading it would execute arbitrary code). "
                       "Convert it to safetensors, e.g. with `safetensors.torch.save_file(torch.load(...))` "
                       "on a trusted machine")


def _collect_entries(ckpt: Path) -> dict[str, _Entry]:
    """Locate the safetensors file(s) of a checkpoint and merge their headers (name -> entry)."""
    if ckpt.is_file():
        if ckpt.suffix in PICKLE_SUFFIXES:
            raise _refuse_pickle(ckpt)
        if ckpt.suffix != ".safetensors":
            raise EngineError(f"{ckpt}: not a checkpoint directory or .safetensors file")
        return _read_header(ckpt)
    if not ckpt.is_dir():
        raise EngineError(f"checkpoint {ckpt}: no such directory")
    index = ckpt / INDEX_NAME
    if index.is_file():
        return _entries_from_index(index)
    if (ckpt / SINGLE_NAME).is_file():
        return _read_header(ckpt / SINGLE_NAME)
    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in ckpt.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise _refuse_pickle(ckpt / pickles[0])
        raise EngineError(f"checkpoint {ckpt}: no *.safetensors file found")
    merged: dict[str, _Entry] = {}
    for f in files:
        for name, entry in _read_header(f).items():
            if name in merged:
                raise EngineError(f"checkpoint {ckpt}: tensor {name} appears in both {merged[name].file.name} "
                                  f"and {f.name}")
            merged[name] = entry
    return merged


def _entries_from_index(index: Path) -> dict[str, _Entry]:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise EngineError(f"{index}: cannot read ({exc})") from exc
    except json.JSONDecodeError as exc:
        raise EngineError(f"{index}: invalid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from exc
    wmap = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
        raise EngineError(f"{index}: missing or malformed 'weight_map' (tensor name -> shard file)")
    headers: dict[str, dict[str, _Entry]] = {}
    for shard in sorted(set(wmap.values())):
        p = index.parent / shard
        if Path(shard).name != shard:
            raise EngineError(f"{index}: shard name {shard!r} must be a plain file name in the checkpoint directory")
        if not p.is_file():
            raise EngineError(f"{index}: shard {shard} is listed but missing")
        if p.suffix in PICKLE_SUFFIXES:
            raise _refuse_pickle(p)
        headers[shard] = _read_header(p)
    merged: dict[str, _Entry] = {}
    for name, shard in wmap.items():
        if name not in headers[shard]:
            raise EngineError(f"{index}: tensor {name} is mapped to {shard} but that file does not contain it")
        merged[name] = headers[shard][name]
    for shard, entries in headers.items():
        unlisted = sorted(set(entries) - set(wmap))
        if unlisted:
            raise EngineError(f"{index}: shard {shard} holds tensor(s) not in the weight_map: "
                              f"{', '.join(unlisted[:5])}")
    return merged


# ---------------------------------------------------------------------------------------------------------
# loading

def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bit patterns -> float32 (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> uint16 bfloat16 bit patterns, round to nearest even (NaN stays NaN)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16
    out = rounded.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = ((u[nan] >> 16) | np.uint32(0x40)).astype(np.uint16)
    return out


def _read_tensor(entry: _Entry, out_dtype: Any) -> np.ndarray:
    storage, _ = _FLOAT_DTYPES[entry.dtype]
    count = int(np.prod(entry.shape, dtype=np.int64))
    with open(entry.file, "rb") as f:
        f.seek(entry.begin)
        arr = np.fromfile(f, dtype=storage, count=count)
    if arr.size != count:
        raise EngineError(f"{entry.file}: truncated while reading tensor (expected {count} elements, got "
                          f"{arr.size})")
    arr = arr.reshape(entry.shape)
    if out_dtype == "bfloat16":
        if entry.dtype == "BF16":
            return arr
        src = arr.astype(np.float32)
        return f32_to_bf16_bits(src).reshape(entry.shape)
    if entry.dtype == "BF16":
        arr = bf16_bits_to_f32(arr)
    return np.ascontiguousarray(arr, dtype=out_dtype)


def load_checkpoint(ckpt_dir: str | Path, cfg: ModelConfig, dtype: Any = np.float32,
                    require_vision: bool = False) -> dict[str, np.ndarray]:
    """Load every decoder tensor (and the optional vision.* tensors) as ``dtype`` arrays by HF name.

    ``dtype``: a numpy float dtype (float32 default, float16, float64) or the string ``"bfloat16"`` for
    uint16 arrays holding bf16 bit patterns (what a bf16 device upload wants). Every file is validated
    (names, shapes, dtypes, truncation) before any tensor is read. With a tied embedding, a redundant
    ``lm_head.weight`` of the right shape is ignored.
    """
    if dtype != "bfloat16":
        dtype = np.dtype(dtype)
        if dtype.kind != "f":
            raise EngineError(f"load_checkpoint: dtype must be a float dtype or 'bfloat16', got {dtype}")
    ckpt = Path(ckpt_dir)
    entries = _collect_entries(ckpt)
    for name in [n for n in entries if n.endswith(_IGNORED_SUFFIXES)]:
        del entries[name]

    want = expected_shapes(cfg)
    vis = vision_shapes(cfg)
    present_vision = [n for n in VISION_TENSORS if n in entries]
    if require_vision or present_vision:
        absent = [n for n in VISION_TENSORS if n not in entries]
        if absent:
            raise EngineError(f"checkpoint {ckpt}: vision tensors incomplete: missing {', '.join(absent)} "
                              f"(either all of {', '.join(VISION_TENSORS)} or none)")
        want.update(vis)
    if cfg.tie_word_embeddings and "lm_head.weight" in entries:
        e = entries["lm_head.weight"]
        if e.shape != (cfg.vocab_size, cfg.hidden_size):
            raise EngineError(f"checkpoint {ckpt}: tensor lm_head.weight: expected shape "
                              f"{[cfg.vocab_size, cfg.hidden_size]} (tied, ignored), found {list(e.shape)}")
        del entries["lm_head.weight"]

    missing = [n for n in want if n not in entries]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise EngineError(f"checkpoint {ckpt}: missing tensor(s) {', '.join(missing[:5])}{more} "
                          f"(config {cfg.source}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size})")
    extra = sorted(n for n in entries if n not in want)
    if extra:
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        raise EngineError(f"checkpoint {ckpt}: unexpected tensor(s) {', '.join(extra[:5])}{more} "
                          f"(not part of a Qwen2 model with this config.json; wrong config or wrong checkpoint?)")
    for name, shape in want.items():
        e = entries[name]
        if e.dtype not in _FLOAT_DTYPES:
            raise EngineError(f"checkpoint {ckpt}: tensor {name}: expected dtype F32, F16 or BF16, found {e.dtype} "
                              f"(in {e.file.name})")
        if e.shape != shape:
            raise EngineError(f"checkpoint {ckpt}: {_shape_mismatch(name, shape, e.shape)} (in {e.file.name})")
    out: dict[str, np.ndarray] = {}
    for name in want:
        out[name] = _read_tensor(entries[name], dtype)
    return out


# ---------------------------------------------------------------------------------------------------------
# writing

_WRITE_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def _write_safetensors(path: Path, tensors: Mapping[str, np.ndarray], tag: str) -> int:
    """Write one safetensors file (names sorted, contiguous data); returns the bytes of tensor data."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        a = np.asarray(tensors[name])
        if tag == "BF16":
            raw = f32_to_bf16_bits(a.astype(np.float32)).tobytes()
        elif tag == "F16":
            raw = np.ascontiguousarray(a, dtype="<f2").tobytes()
        else:
            raw = np.ascontiguousarray(a, dtype="<f4").tobytes()
        header[name] = {"dtype": tag, "shape": list(a.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    hjson = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hjson += b" " * (-len(hjson) % 8)  # the format pads the header to 8-byte alignment
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hjson)))
        f.write(hjson)
        for b in blobs:
            f.write(b)
        f.flush()
        os.fsync(f.fileno())
    return offset


def write_checkpoint(ckpt_dir: str | Path, cfg_dict: Mapping[str, Any], tensors: Mapping[str, np.ndarray],
                     dtype: str = "bfloat16", shards: int = 1) -> Path:
    """Write config.json and the tensors as safetensors (one file, or ``shards`` files plus the index)."""
    if dtype not in _WRITE_DTYPES:
        raise EngineError(f"write_checkpoint: dtype must be one of {', '.join(_WRITE_DTYPES)}, got {dtype!r}")
    if shards < 1:
        raise EngineError(f"write_checkpoint: shards must be >= 1, got {shards}")
    tag = _WRITE_DTYPES[dtype]
    out = Path(ckpt_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(dict(cfg_dict), indent=2) + "\n", encoding="utf-8")
    names = sorted(tensors)
    if shards == 1:
        _write_safetensors(out / SINGLE_NAME, tensors, tag)
        return out
    # greedy balance by bytes, deterministic
    groups: list[list[str]] = [[] for _ in range(shards)]
    sizes = [0] * shards
    for name in sorted(names, key=lambda n: (-np.asarray(tensors[n]).size, n)):
        k = sizes.index(min(sizes))
        groups[k].append(name)
        sizes[k] += np.asarray(tensors[name]).size
    weight_map: dict[str, str] = {}
    total = 0
    for k, group in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        total += _write_safetensors(out / fname, {n: tensors[n] for n in group}, tag)
        weight_map.update({n: fname for n in group})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return out
