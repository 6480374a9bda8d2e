"""The pre-quantised checkpoint (issue 23): one documented layout, written and read here, refused when it differs.

Why a layout of our own rather than GPTQ / AWQ / compressed-tensors: those pack codes for their kernels (AWQ's
interleaved nibble order, GPTQ's int32 words and act-order permutations); the kernels here dequantise exactly
what engine/quant.py defines, and a checkpoint that is read must mean that arithmetic and nothing else. HF's
``quantization_config`` key stays refused by engine/config.py; this layout announces itself with a different key,
``quantization``, so no other tool mistakes it for one of those.

A directory (docs/QUANTIZATION.md has the table):
    config.json                   the HF config plus {"quantization": {"format_version": 1, "weight_dtype": ...,
                                  "layout": ..., "group_size": 128 | null, "scale_dtype": "float32"}}
    model.quantized.safetensors   <name>.qweight (codes), <name>.scales, <name>.zeros (int4) per quantised linear;
                                  every other tensor under its HF name as F32 (exact for a bf16 source: the
                                  safetensors numpy API has no bfloat16), and the same block in __metadata__

Read with safetensors' numpy API (never pickle). Every header entry (names, dtypes, shapes) and the config block
are checked before any tensor is read, then the codes' values (engine/quant.QuantizedLinear's checks): anything
unknown, missing, extra or out of range is refused with ``QuantCheckpointError`` naming it.

Command line (a plain bf16 checkpoint in, the layout out; loading it skips the quantisation at start-up, ~50 s for
a 1.5B model quantised to fp8 with numpy):
    python -m vla_edge_ros.engine.quant_checkpoint SRC DST --weight-dtype int8 | fp8 | int4
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from vla_edge_ros.engine.checkpoint import VISION_TENSORS, expected_shapes, vision_shapes
from vla_edge_ros.engine.config import ModelConfig
from vla_edge_ros.engine.interface import EngineError
from vla_edge_ros.engine.quant import GROUP_SIZE, LAYOUTS, QuantizedLinear, QuantizedModel, is_quantized_name

FORMAT_VERSION = 1
QUANT_FILE = "model.quantized.safetensors"
BLOCK_KEY = "quantization"
FORMAT_NAME = "vla_edge_ros.quantized"
QUANTIZED_DTYPES = ("int8", "fp8", "int4")
_BLOCK_KEYS = ("format_version", "weight_dtype", "layout", "group_size", "scale_dtype")
_CODE_DTYPES = {"int8": "I8", "fp8": "U8", "int4": "U8"}  # safetensors tags of <name>.qweight


class QuantCheckpointError(EngineError, ValueError):
    """A pre-quantised checkpoint that is not the documented layout (or not readable)."""


def quantization_block(weight_dtype: str) -> dict[str, Any]:
    """The config.json block (and safetensors metadata) that describes a checkpoint in ``weight_dtype``."""
    if weight_dtype not in QUANTIZED_DTYPES:
        raise QuantCheckpointError(f"pre-quantised weight_dtype must be one of {', '.join(QUANTIZED_DTYPES)}, "
                                   f"got {weight_dtype!r} (a bf16 model is an ordinary checkpoint)")
    return {"format_version": FORMAT_VERSION, "weight_dtype": weight_dtype, "layout": LAYOUTS[weight_dtype],
            "group_size": GROUP_SIZE if weight_dtype == "int4" else None, "scale_dtype": "float32"}


def is_quantized_checkpoint(ckpt_dir: str | Path) -> bool:
    """True when config.json carries the ``quantization`` block (whether or not it is valid)."""
    try:
        data = json.loads((Path(ckpt_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and BLOCK_KEY in data


# ---- writing ---------------------------------------------------------------------------------------------------

def write_quantized_checkpoint(ckpt_dir: str | Path, cfg_dict: Mapping[str, Any], model: QuantizedModel) -> Path:
    """Write ``model`` (engine/quant.quantize_weights) with its config as the documented layout. The tensors go
    to a temporary file renamed into place, config.json last: a crash never leaves a readable half."""
    block = quantization_block(model.weight_dtype)
    if model.weight_dtype == "int4" and model.group_size != GROUP_SIZE:
        raise QuantCheckpointError(f"the documented int4 layout has group_size {GROUP_SIZE}, the model was "
                                   f"quantised with {model.group_size}")
    if "quantization_config" in cfg_dict:
        raise QuantCheckpointError("cfg_dict carries an HF quantization_config; this layout is not that one")
    tensors: dict[str, np.ndarray] = {}
    for name, q in model.linear.items():
        if q.weight_dtype != model.weight_dtype:
            raise QuantCheckpointError(f"tensor {name} is {q.weight_dtype}, the model is {model.weight_dtype}")
        tensors[name + ".qweight"], tensors[name + ".scales"] = q.codes, q.scales
        if q.zeros is not None:
            tensors[name + ".zeros"] = q.zeros
    for name, a in model.dense.items():
        tensors[name] = np.ascontiguousarray(a, dtype=np.float32)
    out = Path(ckpt_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{QUANT_FILE}.tmp-{os.getpid()}"  # same directory: the rename is atomic
    try:
        save_file({n: np.ascontiguousarray(a) for n, a in tensors.items()}, str(tmp), metadata=_metadata(block))
        os.replace(tmp, out / QUANT_FILE)
    finally:
        if tmp.exists():
            tmp.unlink()
    config = {k: v for k, v in cfg_dict.items() if k != BLOCK_KEY}
    config[BLOCK_KEY] = block
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out


def _metadata(block: Mapping[str, Any]) -> dict[str, str]:
    return {"format": FORMAT_NAME, **{k: json.dumps(v) for k, v in block.items()}}  # metadata is str -> str


# ---- reading ---------------------------------------------------------------------------------------------------

def read_quantization_block(ckpt_dir: str | Path) -> dict[str, Any]:
    """The checked ``quantization`` block of config.json (refused when absent, unknown or not this layout)."""
    path = Path(ckpt_dir) / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise QuantCheckpointError(f"{path}: cannot read ({exc})") from exc
    block = data.get(BLOCK_KEY) if isinstance(data, dict) else None
    if block is None:
        raise QuantCheckpointError(f"{path}: no '{BLOCK_KEY}' block, so not a pre-quantised checkpoint: load it "
                                   "with engine.checkpoint.load_checkpoint and quantise at load")
    if not isinstance(block, dict):
        raise QuantCheckpointError(f"{path}: '{BLOCK_KEY}' must be a JSON object, got {block!r}")
    unknown = sorted(set(block) - set(_BLOCK_KEYS))
    if unknown:
        raise QuantCheckpointError(f"{path}: '{BLOCK_KEY}' has unknown key(s) {', '.join(unknown)} (a newer or "
                                   f"different layout?); this reader knows {', '.join(_BLOCK_KEYS)}")
    version = block.get("format_version")
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise QuantCheckpointError(f"{path}: {BLOCK_KEY}.format_version={version!r}; this reader implements "
                                   f"format_version {FORMAT_VERSION} only (docs/QUANTIZATION.md)")
    wd = block.get("weight_dtype")
    if wd not in QUANTIZED_DTYPES:
        raise QuantCheckpointError(f"{path}: {BLOCK_KEY}.weight_dtype={wd!r}; expected one of "
                                   f"{', '.join(QUANTIZED_DTYPES)}")
    want = quantization_block(wd)
    for key in _BLOCK_KEYS:
        if block.get(key, "<absent>") != want[key]:
            raise QuantCheckpointError(f"{path}: {BLOCK_KEY}.{key}={block.get(key, '<absent>')!r}, but the "
                                       f"documented {wd} layout has {want[key]!r} (a kernel would dequantise "
                                       "these codes wrongly, so they are refused)")
    return want


def read_quantized_checkpoint(ckpt_dir: str | Path,
                              weight_dtype: str | None = None) -> tuple[ModelConfig, QuantizedModel]:
    """Read a checkpoint written by ``write_quantized_checkpoint``. ``weight_dtype``: what the caller was
    configured for; a checkpoint in another one is refused (re-quantise from bf16, or configure that one)."""
    ckpt = Path(ckpt_dir)
    block = read_quantization_block(ckpt)
    wd = block["weight_dtype"]
    if weight_dtype is not None and weight_dtype != wd:
        raise QuantCheckpointError(f"checkpoint {ckpt} is pre-quantised as {wd}, weight_dtype={weight_dtype!r} "
                                   f"was asked: set weight_dtype: {wd}, or load the bf16 checkpoint to quantise "
                                   f"as {weight_dtype}")
    cfg = ModelConfig.from_json(ckpt)
    path = ckpt / QUANT_FILE
    if not path.is_file():
        raise QuantCheckpointError(f"checkpoint {ckpt}: {QUANT_FILE} missing (config.json says pre-quantised)")
    try:
        with safe_open(str(path), framework="numpy") as f:
            _check_metadata(path, f.metadata() or {}, block)
            header = {n: (f.get_slice(n).get_dtype(), tuple(f.get_slice(n).get_shape())) for n in f.keys()}
            want = _expected_entries(cfg, wd, header, path)
            _check_header(path, header, want)
            tensors = {n: f.get_tensor(n) for n in want}
    except SafetensorError as exc:
        raise QuantCheckpointError(f"{path}: not a readable safetensors file ({exc})") from exc
    linear, dense = {}, {}
    for name in _names(want):
        if not is_quantized_name(name):
            dense[name] = tensors[name]
            continue
        try:
            linear[name] = QuantizedLinear(wd, tensors[name + ".qweight"], tensors[name + ".scales"],
                                           want[name + ".qweight"][2], tensors.get(name + ".zeros"),
                                           block["group_size"])
        except ValueError as exc:
            raise QuantCheckpointError(f"{path}: tensor {name}: {exc}") from exc
    return cfg, QuantizedModel(wd, linear, dense, block["group_size"])


def _check_metadata(path: Path, meta: Mapping[str, str], block: Mapping[str, Any]) -> None:
    want = _metadata(block)
    for key, value in want.items():
        if meta.get(key) != value:
            raise QuantCheckpointError(f"{path}: safetensors metadata {key}={meta.get(key)!r}, config.json's "
                                       f"block says {value!r}: the tensors and config.json disagree")


def _names(want: Mapping[str, tuple]) -> list[str]:
    """The model's tensor names (HF names) behind the file's entry names."""
    return sorted({n.rsplit(".", 1)[0] if n.endswith((".qweight", ".scales", ".zeros")) else n for n in want})


def _expected_entries(cfg: ModelConfig, wd: str, header: Mapping[str, tuple], path: Path) -> dict[str, tuple]:
    """File entry name -> (safetensors dtype tag, shape, original (out, in) for .qweight) the config implies."""
    shapes = expected_shapes(cfg)
    present = [n for n in VISION_TENSORS if n in header]
    if present:
        if len(present) != len(VISION_TENSORS):
            missing = sorted(set(VISION_TENSORS) - set(present))
            raise QuantCheckpointError(f"{path}: vision tensors incomplete: missing {', '.join(missing)}")
        shapes.update(vision_shapes(cfg))
    want: dict[str, tuple] = {}
    for name, shape in shapes.items():
        if not is_quantized_name(name):
            want[name] = ("F32", shape, None)
            continue
        out, k = shape
        groups = -(-k // GROUP_SIZE)
        want[name + ".qweight"] = (_CODE_DTYPES[wd], (out, (k + 1) // 2) if wd == "int4" else (out, k), shape)
        want[name + ".scales"] = ("F32", (out, groups) if wd == "int4" else (out,), None)
        if wd == "int4":
            want[name + ".zeros"] = ("U8", (out, groups), None)
    return want


def _check_header(path: Path, header: Mapping[str, tuple], want: Mapping[str, tuple]) -> None:
    def listing(names: list[str]) -> str:
        return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")

    missing = sorted(set(want) - set(header))
    if missing:
        raise QuantCheckpointError(f"{path}: missing tensor(s) {listing(missing)} (the config's geometry and the "
                                   "documented layout ask for them)")
    extra = sorted(set(header) - set(want))
    if extra:
        raise QuantCheckpointError(f"{path}: unexpected tensor(s) {listing(extra)} (not part of this layout: a "
                                   "float copy of a quantised weight, or another quantiser's tensors?)")
    for name, (tag, shape, _) in want.items():
        if header[name] != (tag, shape):
            raise QuantCheckpointError(f"{path}: tensor {name}: expected {tag} {list(shape)}, found "
                                       f"{header[name][0]} {list(header[name][1])}")


def refuse_requantizing(src: Path, dst: Path) -> None:
    """What every writer of this layout refuses before reading anything: a source that is already pre-quantised
    (requantising codes compounds their error) and a ``dst`` that exists and is not an empty directory (nothing is
    overwritten)."""
    if is_quantized_checkpoint(src):
        raise QuantCheckpointError(f"{src} is already a pre-quantised checkpoint; quantise its bf16 source")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise QuantCheckpointError(f"{dst} exists and is not empty (or not a directory); choose a new directory")


def quantize_checkpoint(src: str | Path, dst: str | Path, weight_dtype: str) -> QuantizedModel:
    """Read the plain checkpoint ``src`` (config.json + safetensors), quantise it as the engines do at load and
    write it to ``dst`` in the documented layout. Refused: a source that is already pre-quantised (requantising
    codes compounds their error), a ``dst`` that exists and is not empty (nothing is overwritten)."""
    from vla_edge_ros.engine.checkpoint import load_checkpoint
    from vla_edge_ros.engine.quant import quantize_weights
    src, dst = Path(src), Path(dst)
    refuse_requantizing(src, dst)
    cfg_dict = json.loads((src / "config.json").read_text(encoding="utf-8"))
    cfg = ModelConfig.from_json(cfg_dict)
    model = quantize_weights(load_checkpoint(src, cfg), weight_dtype)
    write_quantized_checkpoint(dst, cfg_dict, model)
    return model


def main(argv: list[str] | None = None) -> int:
    """python -m vla_edge_ros.engine.quant_checkpoint SRC DST --weight-dtype int8|fp8|int4"""
    import argparse
    import time

    from vla_edge_ros.engine.quant import WEIGHT_DTYPES
    ap = argparse.ArgumentParser(prog="python -m vla_edge_ros.engine.quant_checkpoint",
                                 description="Write a pre-quantised checkpoint (docs/QUANTIZATION.md) from a plain one.")
    ap.add_argument("src", help="plain checkpoint directory (config.json + safetensors, bf16 or float)")
    ap.add_argument("dst", help="new directory for the pre-quantised checkpoint")
    ap.add_argument("--weight-dtype", required=True, choices=[w for w in WEIGHT_DTYPES if w != "bf16"])
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        model = quantize_checkpoint(args.src, args.dst, args.weight_dtype)
    except (EngineError, OSError, ValueError) as exc:
        print(f"quant_checkpoint: {exc}")
        return 2
    size = (Path(args.dst) / QUANT_FILE).stat().st_size
    print(f"quant_checkpoint: {len(model.linear)} linear weights as {args.weight_dtype}, {len(model.dense)} tensors "
          f"kept; {Path(args.dst) / QUANT_FILE}: {size / 2**20:.1f} MiB in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
