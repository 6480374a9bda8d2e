"""Model geometry from an HF Qwen2 ``config.json`` plus the VLA-specific ``"vla"`` block.

The ``"vla"`` block (all keys optional; defaults below) describes the action head and the patch embedder:

    action_dims   7                        one greedy decode step per dimension
    action_names  x y z roll pitch yaw gripper
    action_q01    [-0.05]*6 + [0.0]        per-dimension 1st percentile (un-normalisation low end)
    action_q99    [ 0.05]*6 + [1.0]        per-dimension 99th percentile (un-normalisation high end)
    n_action_bins 256                      the LAST 256 vocabulary rows are the action bins over [-1, 1]
    patch_grid    [4, 8]                   rows x columns of patches -> 32 vision tokens per frame
    patch_size    16                       pixels; the image is resized to 64 x 128 (grid * patch_size)
    action_horizon 1                       H: actions per chunk, one per control period (1 = single step);
                                           the chunk is an (H, action_dims) array (engine/interface.ChunkResult)
    chunk_decode  "autoregressive"         how the H x action_dims action tokens are decoded: "autoregressive"
                                           (one greedy step per token) or "parallel" (all action slots in one
                                           pass, OpenVLA-OFT style). Parsed and validated here; a backend that
                                           cannot decode what a checkpoint asks for refuses it at configure by
                                           name (Engine.chunk_support_problem)
    action_start  "token"                  what the prefill's last logits give (issue 23 §1): "token" (the seed
                                           shape: an action-start token, then one decode step per bin and an end
                                           token: 1 prefill + decode_tokens passes) or "prefill" (bin 1 itself,
                                           then action_dims - 1 decode steps, OpenVLA's shape: 7 passes for 7
                                           bins, whatever decode_tokens says). A backend without it refuses it
                                           at configure by name

The q01/q99 defaults are generic placeholders (end-effector deltas of a few centimetres / centiradians per
step, gripper in [0, 1]); a real checkpoint should carry its dataset's statistics.

The vocabulary must hold the 256 byte tokens used for the instruction prefix (byte b -> id b) below the
action rows, so ``vocab_size >= 256 + n_action_bins``.

HF keys that change the math. The engine must compute what HF's ``Qwen2ForCausalLM`` computes for the same
config.json (transformers 4.x and 5.x); a key it cannot honour is refused here, at configure, by name
(``ModelConfigError``, both an ``EngineError`` and a ``ValueError``), never ignored. Absent keys take HF
``Qwen2Config``'s defaults, not values of our own.

    rope_theta                honoured; read at the top level (4.x) AND inside ``rope_parameters`` (5.x) /
                              ``rope_scaling`` (also per layer type: {"full_attention": {...}}); several given
                              and different: refused, naming each; none given: 10000.0 (HF default_theta)
    rope_parameters /         null, {} or rope_type (legacy spelling: type) "default": honoured. Any other type
      rope_scaling            (linear, dynamic, yarn, longrope, llama3, mrope, ...), a key default RoPE does not
                              read (factor, mrope_section, ...) or partial_rotary_factor != 1: refused
    partial_rotary_factor     top level: absent / null / 1.0 only; anything else refused
    use_sliding_window,       honoured where it cannot bind: off, or window >= max_position_embeddings (the
      sliding_window,         runtime never holds more tokens than that). A window that some layer
      max_window_layers,      (layer_types, or layers >= max_window_layers; HF's rule) would apply below
      layer_types             max_position_embeddings is refused; a layer type other than full_attention /
                              sliding_attention is refused
    hidden_act                silu (or its alias swish) only
    head_dim                  absent / null / hidden_size / num_attention_heads only
    num_key_value_heads       absent: 32 (HF Qwen2Config's default); null: num_attention_heads (HF's rule)
    tie_word_embeddings       honoured (true: LM head = embedding; false: lm_head.weight); absent: false (HF)
    attention_bias            absent / true only: Qwen2 q/k/v projections always carry biases (HF Qwen2 hard-
                              codes them); false (a layout without them) refused
    model_type                absent or "qwen2" only (qwen3, llama, qwen2_vl, ... differ in layout or RoPE)
    quantization_config       refused (packed / scaled weights are not implemented)
    rms_norm_eps, max_position_embeddings   honoured; absent: 1e-6, 32768 (HF)

Read and deliberately not used (no effect on greedy inference): attention_dropout, initializer_range,
use_cache, bos/eos/pad_token_id, torch_dtype / dtype (the checkpoint's tensors say), architectures,
transformers_version.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from vla_edge_ros.engine.interface import EngineError

BYTE_TOKENS = 256  # instruction bytes map to ids 0..255

DEFAULT_ACTION_NAMES = ("x", "y", "z", "roll", "pitch", "yaw", "gripper")
DEFAULT_Q01 = (-0.05, -0.05, -0.05, -0.05, -0.05, -0.05, 0.0)
DEFAULT_Q99 = (0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 1.0)

_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")

# HF defaults for keys absent from config.json (transformers Qwen2Config / RotaryEmbeddingConfigMixin)
HF_DEFAULT_ROPE_THETA = 10_000.0
HF_DEFAULT_KV_HEADS = 32
HF_DEFAULT_SLIDING_WINDOW = 4096
HF_DEFAULT_MAX_WINDOW_LAYERS = 28

LAYER_TYPES = ("full_attention", "sliding_attention")
_ROPE_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")  # all that default RoPE reads
_ACTIVATIONS = ("silu", "swish")  # one function under two names in HF's ACT2FN
CHUNK_DECODES = ("autoregressive", "parallel")
ACTION_STARTS = ("token", "prefill")  # vla.action_start: what the prefill's last logits give


class ModelConfigError(EngineError, ValueError):
    """config.json is malformed or asks for maths the kernels do not implement (refused at configure)."""


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 32768
    rope_theta: float = HF_DEFAULT_ROPE_THETA
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    # ---- "vla" block
    action_dims: int = 7
    action_names: tuple[str, ...] = DEFAULT_ACTION_NAMES
    action_q01: tuple[float, ...] = DEFAULT_Q01
    action_q99: tuple[float, ...] = DEFAULT_Q99
    n_action_bins: int = 256
    patch_grid: tuple[int, int] = (4, 8)
    patch_size: int = 16
    action_horizon: int = 1
    chunk_decode: str = "autoregressive"
    action_start: str = "token"
    source: str = field(default="<dict>", compare=False)  # where it came from, for error messages

    # ---- derived geometry
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def n_groups(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def n_patches(self) -> int:
        return self.patch_grid[0] * self.patch_grid[1]

    @property
    def patch_dim(self) -> int:
        return self.patch_size * self.patch_size * 3

    @property
    def image_hw(self) -> tuple[int, int]:
        return self.patch_grid[0] * self.patch_size, self.patch_grid[1] * self.patch_size

    @property
    def action_token_offset(self) -> int:
        """Vocabulary id of action bin 0."""
        return self.vocab_size - self.n_action_bins

    # ---- construction
    @classmethod
    def from_json(cls, path_or_dict: str | Path | Mapping[str, Any]) -> "ModelConfig":
        """Read an HF Qwen2 config (a path to config.json, a checkpoint directory, or a dict).

        Raises ``ModelConfigError`` (an ``EngineError``) for a malformed config or one whose maths the kernels do
        not implement (module docstring), ``EngineError`` for a missing / unreadable file.
        """
        if isinstance(path_or_dict, Mapping):
            return cls._from_dict(path_or_dict, "<dict>")
        path = Path(path_or_dict)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise EngineError(f"model config {path}: file not found")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise EngineError(f"model config {path}: cannot read ({exc})") from exc
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise EngineError(f"model config {path}: invalid JSON ({exc.msg} at line {exc.lineno}, "
                              f"column {exc.colno})") from exc
        if not isinstance(data, dict):
            raise EngineError(f"model config {path}: top level must be a JSON object, got {type(data).__name__}")
        return cls._from_dict(data, str(path))

    @classmethod
    def _from_dict(cls, d: Mapping[str, Any], source: str) -> "ModelConfig":
        def fail(msg: str) -> ModelConfigError:
            return ModelConfigError(f"model config {source}: {msg}")

        missing = [k for k in _REQUIRED if k not in d]
        if missing:
            raise fail(f"missing required key(s) {', '.join(missing)}")

        def int_key(m: Mapping[str, Any], key: str, default: Any = None, lo: int = 1) -> int:
            v = m.get(key, default)
            if isinstance(v, bool) or not isinstance(v, int):
                raise fail(f"{key} must be an integer, got {v!r}")
            if v < lo:
                raise fail(f"{key}={v} must be >= {lo}")
            return v

        _refuse_other_models(d, fail)
        heads = int_key(d, "num_attention_heads")
        kv_heads = d.get("num_key_value_heads", HF_DEFAULT_KV_HEADS)  # HF: absent -> 32, null -> heads
        kwargs: dict[str, Any] = dict(
            hidden_size=int_key(d, "hidden_size"),
            num_hidden_layers=int_key(d, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=int_key({"num_key_value_heads": heads if kv_heads is None else kv_heads},
                                        "num_key_value_heads"),
            intermediate_size=int_key(d, "intermediate_size"),
            vocab_size=int_key(d, "vocab_size"),
            max_position_embeddings=int_key(d, "max_position_embeddings", 32768),
            rope_theta=rope_theta_of(d, fail),
            rms_norm_eps=_positive_number(d.get("rms_norm_eps", 1e-6), "rms_norm_eps", fail),
        )
        tie = d.get("tie_word_embeddings", False)
        if not isinstance(tie, bool):
            raise fail(f"tie_word_embeddings must be true or false, got {tie!r}")
        kwargs["tie_word_embeddings"] = tie

        act = d.get("hidden_act", "silu")
        if act not in _ACTIVATIONS:
            raise fail(f"hidden_act={act!r} is not implemented by vla_edge_ros (Qwen2 uses 'silu')")
        _check_sliding_window(d, kwargs["num_hidden_layers"], kwargs["max_position_embeddings"], fail)

        vla = d.get("vla", {})
        if vla is None:
            vla = {}
        if not isinstance(vla, Mapping):
            raise fail(f"'vla' must be an object, got {type(vla).__name__}")
        dims = int_key(vla, "action_dims", 7)
        names = vla.get("action_names")
        if names is None:
            names = DEFAULT_ACTION_NAMES if dims == 7 else tuple(f"a{i}" for i in range(dims))
        q01 = vla.get("action_q01", DEFAULT_Q01 if dims == 7 else None)
        q99 = vla.get("action_q99", DEFAULT_Q99 if dims == 7 else None)
        if q01 is None or q99 is None:
            raise fail(f"vla.action_q01 / vla.action_q99 are required when action_dims={dims} (defaults exist "
                       "only for 7 dimensions)")
        for key, seq in (("action_names", names), ("action_q01", q01), ("action_q99", q99)):
            if not isinstance(seq, (list, tuple)) or len(seq) != dims:
                raise fail(f"vla.{key} must be a list of {dims} entries (action_dims), got {seq!r}")
        if not all(isinstance(n, str) and n for n in names):
            raise fail(f"vla.action_names must be non-empty strings, got {names!r}")
        for key, seq in (("action_q01", q01), ("action_q99", q99)):
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in seq):
                raise fail(f"vla.{key} must hold finite numbers, got {seq!r}")
        bad = [i for i in range(dims) if not q01[i] <= q99[i]]
        if bad:
            raise fail(f"vla.action_q01 must be <= vla.action_q99 in every dimension; not so in dimension(s) "
                       f"{', '.join(names[i] for i in bad)}")
        grid = vla.get("patch_grid", [4, 8])
        if (not isinstance(grid, (list, tuple)) or len(grid) != 2
                or not all(isinstance(g, int) and not isinstance(g, bool) and g >= 1 for g in grid)):
            raise fail(f"vla.patch_grid must be two positive integers [rows, cols], got {grid!r}")
        decode = vla.get("chunk_decode", "autoregressive")
        if decode not in CHUNK_DECODES:
            raise fail(f"vla.chunk_decode={decode!r} is not one of {', '.join(CHUNK_DECODES)}")
        start = vla.get("action_start", "token")
        if not isinstance(start, str) or start not in ACTION_STARTS:
            raise fail(f"vla.action_start={start!r} is not one of {', '.join(ACTION_STARTS)}")
        kwargs.update(
            action_dims=dims,
            action_names=tuple(names),
            action_q01=tuple(float(x) for x in q01),
            action_q99=tuple(float(x) for x in q99),
            n_action_bins=int_key(vla, "n_action_bins", 256, lo=2),
            patch_grid=(int(grid[0]), int(grid[1])),
            patch_size=int_key(vla, "patch_size", 16),
            action_horizon=int_key(vla, "action_horizon", 1),
            chunk_decode=decode,
            action_start=start,
            source=source,
        )
        cfg = cls(**kwargs)
        cfg._validate(fail, d)
        return cfg

    def _validate(self, fail, d: Mapping[str, Any]) -> None:
        if "num_key_value_heads" not in d and self.num_attention_heads % self.num_key_value_heads:
            raise fail(f"num_key_value_heads is absent, so HF Qwen2Config's default {HF_DEFAULT_KV_HEADS} applies, "
                       f"and it does not divide num_attention_heads={self.num_attention_heads}; write "
                       "num_key_value_heads into config.json")
        if self.hidden_size % self.num_attention_heads:
            raise fail(f"num_attention_heads={self.num_attention_heads} does not divide "
                       f"hidden_size={self.hidden_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise fail(f"num_key_value_heads={self.num_key_value_heads} does not divide "
                       f"num_attention_heads={self.num_attention_heads}")
        if self.head_dim % 2:
            raise fail(f"head_dim={self.head_dim} (hidden_size / num_attention_heads) must be even for RoPE")
        if d.get("head_dim") is not None and d["head_dim"] != self.head_dim:
            raise fail(f"head_dim={d['head_dim']!r} differs from hidden_size / num_attention_heads = "
                       f"{self.head_dim}; only the Qwen2 layout is supported")
        if self.vocab_size < BYTE_TOKENS + self.n_action_bins:
            raise fail(f"vocab_size={self.vocab_size} is too small: it must hold the {BYTE_TOKENS} byte tokens "
                       f"of the instruction plus n_action_bins={self.n_action_bins} action rows")

    def to_dict(self) -> dict[str, Any]:
        """The HF-style dict (with its ``vla`` block) that ``from_json`` reads back to an equal config."""
        d = asdict(self)
        d.pop("source")
        vla = {k: d.pop(k) for k in ("action_dims", "action_names", "action_q01", "action_q99", "n_action_bins",
                                      "patch_grid", "patch_size", "action_horizon", "chunk_decode",
                                      "action_start")}
        vla = {k: list(v) if isinstance(v, tuple) else v for k, v in vla.items()}
        d.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu", vla=vla)
        return d


# ---- HF keys that change the math (see the module docstring for the list) --------------------------------

def _positive_number(value: Any, where: str, fail) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise fail(f"{where} must be a positive finite number, got {value!r}")
    return float(value)


def _rope_dicts(d: Mapping[str, Any], key: str, fail) -> list[tuple[str, Mapping[str, Any]]]:
    """(name, dict) for each RoPE parameter dict under ``key``: one, or one per layer type (5.x nesting)."""
    value = d.get(key)
    if value is None or value == {}:
        return []
    if not isinstance(value, Mapping):
        raise fail(f"{key} must be an object or null, got {value!r}")
    layer_types = d.get("layer_types")
    names = set(LAYER_TYPES)
    if isinstance(layer_types, list):
        names |= {t for t in layer_types if isinstance(t, str)}
    nested = set(value) <= names and all(isinstance(v, Mapping) or v is None for v in value.values())
    if nested:
        return [(f"{key}.{name}", sub) for name, sub in value.items() if sub]
    return [(key, value)]


def _check_rope_dict(where: str, params: Mapping[str, Any], fail) -> None:
    """Refuse, by name, anything but plain (default) RoPE: the kernels implement exactly that."""
    for k in ("rope_type", "type"):
        if k in params and not isinstance(params[k], str):
            raise fail(f"{where}.{k} must be a string, got {params[k]!r}")
    kinds = {params[k] for k in ("rope_type", "type") if k in params}
    if len(kinds) > 1:
        raise fail(f"{where} gives rope_type={params['rope_type']!r} and type={params['type']!r}; they disagree")
    kind = kinds.pop() if kinds else "default"
    if kind != "default":
        raise fail(f"{where} type {kind!r} is not implemented by vla_edge_ros (only default RoPE)")
    if "mrope_section" in params:
        raise fail(f"{where}.mrope_section: multimodal RoPE (mrope) is not implemented by vla_edge_ros "
                   "(only default RoPE)")
    factor = params.get("partial_rotary_factor")
    if factor is not None and factor != 1:
        raise fail(f"{where}.partial_rotary_factor={factor!r} is not implemented by vla_edge_ros (RoPE over the "
                   "whole head only)")
    unknown = sorted(k for k in params if k not in _ROPE_KEYS)
    if unknown:
        raise fail(f"{where} has key(s) {', '.join(unknown)} that default RoPE does not use; vla_edge_ros "
                   "implements only default RoPE (rope_type 'default', rope_theta), so a config asking for "
                   "more is refused rather than half-honoured")


def rope_theta_of(d: Mapping[str, Any], fail) -> float:
    """The RoPE base HF uses for config ``d``, wherever it is written; refuse a non-default RoPE by name.

    transformers 5.x writes ``"rope_parameters": {"rope_type": "default", "rope_theta": ...}`` and no top-level
    ``rope_theta``; 4.x writes the top-level key and ``"rope_scaling": null``. Every place it is given must
    agree (HF would silently prefer one of them); absent everywhere, HF's default 10000.0 applies.
    """
    found: list[tuple[str, float]] = []
    if "rope_theta" in d:
        found.append(("rope_theta", _positive_number(d["rope_theta"], "rope_theta", fail)))
    for key in ("rope_parameters", "rope_scaling"):
        for where, params in _rope_dicts(d, key, fail):
            _check_rope_dict(where, params, fail)
            if "rope_theta" in params:
                name = f"{where}.rope_theta"
                found.append((name, _positive_number(params["rope_theta"], name, fail)))
    factor = d.get("partial_rotary_factor")
    if factor is not None and factor != 1:
        raise fail(f"partial_rotary_factor={factor!r} is not implemented by vla_edge_ros (RoPE over the whole "
                   "head only)")
    if not found:
        return HF_DEFAULT_ROPE_THETA
    if len({v for _, v in found}) > 1:
        raise fail("the RoPE base is given more than once with different values: "
                   + ", ".join(f"{name}={v!r}" for name, v in found)
                   + "; make them agree (or keep one) so the runtime and HF use the same rotation")
    return found[0][1]


def _check_sliding_window(d: Mapping[str, Any], layers: int, max_pos: int, fail) -> None:
    """Accept sliding-window attention only where it cannot bind (the kernels attend over the whole context).

    HF's rule (Qwen2Config): the window is ``sliding_window`` when ``use_sliding_window`` else none; it applies to
    the layers ``layer_types`` marks "sliding_attention", or when that is absent to layers >= max_window_layers.
    A query sees the keys less than ``window`` positions back, and the runtime's positions stay below
    ``max_position_embeddings``, so a window >= that limit changes nothing.
    """
    layer_types = d.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != layers:
            raise fail(f"layer_types must be a list of {layers} entries (num_hidden_layers), got {layer_types!r}")
        other = sorted({repr(t) for t in layer_types if t not in LAYER_TYPES})
        if other:
            raise fail(f"layer_types {', '.join(other)} not implemented by vla_edge_ros (only "
                       f"{', '.join(LAYER_TYPES)})")
    use = d.get("use_sliding_window", False)
    if not isinstance(use, bool):
        raise fail(f"use_sliding_window must be true or false, got {use!r}")
    window = d.get("sliding_window", HF_DEFAULT_SLIDING_WINDOW)
    if not use or window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise fail(f"sliding_window must be a positive integer or null, got {window!r}")
    if layer_types is not None:
        sliding = [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
    else:
        first = d.get("max_window_layers", HF_DEFAULT_MAX_WINDOW_LAYERS)
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise fail(f"max_window_layers must be a non-negative integer, got {first!r}")
        sliding = list(range(first, layers))
    if sliding and window < max_pos:
        raise fail(f"use_sliding_window=true: layers {sliding[0]}..{sliding[-1]} would attend only to the last "
                   f"{window} tokens (sliding_window), but vla_edge_ros attends over the whole context, up to "
                   f"max_position_embeddings={max_pos}; sliding-window attention is not implemented (set "
                   f"max_position_embeddings <= {window} to keep the context inside the window, or "
                   "use_sliding_window=false if the model was trained without it)")


def _refuse_other_models(d: Mapping[str, Any], fail) -> None:
    """Keys saying the weights are not the plain float Qwen2 layout the kernels implement."""
    model_type = d.get("model_type")
    if model_type is not None and model_type != "qwen2":
        raise fail(f"model_type={model_type!r} is not implemented by vla_edge_ros (only 'qwen2')")
    bias = d.get("attention_bias")
    if bias is not None and bias is not True:
        raise fail(f"attention_bias={bias!r}: vla_edge_ros implements the Qwen2 layout, whose q/k/v projections "
                   "always carry biases (HF Qwen2 hard-codes them); a layout without them is not implemented")
    if d.get("quantization_config") is not None:
        method = d["quantization_config"]
        method = method.get("quant_method", method) if isinstance(method, Mapping) else method
        raise fail(f"quantization_config ({method!r}) is not implemented by vla_edge_ros (float weights only: "
                   "F32, F16 or BF16)")


def _qwen_common() -> dict[str, Any]:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rope_theta": 1_000_000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "vocab_size": 151936,
        "num_key_value_heads": 2,
    }


def qwen2_5_1_5b_dict() -> dict[str, Any]:
    """Geometry of Qwen2.5-1.5B (weights not included)."""
    return {**_qwen_common(), "hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12,
            "intermediate_size": 8960}


def qwen2_5_0_5b_dict() -> dict[str, Any]:
    """Geometry of Qwen2.5-0.5B (weights not included)."""
    return {**_qwen_common(), "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
            "intermediate_size": 4864}


def tiny_default_dict() -> dict[str, Any]:
    """Geometry of the embedded tiny default checkpoint (see engine/tiny_default.py).

    Two layers because this is the CPU default and the layer count is what a CPU chunk costs: on the documented
    2-core machine (numpy, OPENBLAS_NUM_THREADS=1, kv 512) a chunk took p50 16.3 ms alone with 4 layers and
    8.3 ms with 2 (16 instead of 32 tokens per frame saved only 1 ms), and inside the runtime, next to the
    60 Hz VGA camera and the 30 Hz timer, about twice that: 4 layers could not keep the 31 ms budget
    (docs/FIGURES.md "CPU defaults").
    """
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 704,
        "vocab_size": 512,
        "max_position_embeddings": 8192,
        "rope_theta": 1_000_000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "vla": {
            "action_dims": 7,
            "action_names": list(DEFAULT_ACTION_NAMES),
            "action_q01": list(DEFAULT_Q01),
            "action_q99": list(DEFAULT_Q99),
            "n_action_bins": 256,
            "patch_grid": [4, 8],
            "patch_size": 16,
        },
    }
