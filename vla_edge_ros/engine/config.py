"""Model geometry from an HF Qwen2 ``config.json`` plus the VLA-specific ``"vla"`` block.

The ``"vla"`` block (all keys optional; defaults below) describes the action head and the patch embedder:

    action_dims   7                        one greedy decode step per dimension
    action_names  x y z roll pitch yaw gripper
    action_q01    [-0.05]*6 + [0.0]        per-dimension 1st percentile (un-normalisation low end)
    action_q99    [ 0.05]*6 + [1.0]        per-dimension 99th percentile (un-normalisation high end)
    n_action_bins 256                      the LAST 256 vocabulary rows are the action bins over [-1, 1]
    patch_grid    [4, 8]                   rows x columns of patches -> 32 vision tokens per frame
    patch_size    16                       pixels; the image is resized to 64 x 128 (grid * patch_size)

The q01/q99 defaults are generic placeholders (end-effector deltas of a few centimetres / centiradians per
step, gripper in [0, 1]); a real checkpoint should carry its dataset's statistics.

The vocabulary must hold the 256 byte tokens used for the instruction prefix (byte b -> id b) below the
action rows, so ``vocab_size >= 256 + n_action_bins``.
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


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 32768
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    # ---- "vla" block
    action_dims: int = 7
    action_names: tuple[str, ...] = DEFAULT_ACTION_NAMES
    action_q01: tuple[float, ...] = DEFAULT_Q01
    action_q99: tuple[float, ...] = DEFAULT_Q99
    n_action_bins: int = 256
    patch_grid: tuple[int, int] = (4, 8)
    patch_size: int = 16
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
        """Read an HF Qwen2 config (a path to config.json, a checkpoint directory, or a dict)."""
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
        def fail(msg: str) -> EngineError:
            return EngineError(f"model config {source}: {msg}")

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

        def float_key(m: Mapping[str, Any], key: str, default: float) -> float:
            v = m.get(key, default)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise fail(f"{key} must be a positive finite number, got {v!r}")
            return float(v)

        heads = int_key(d, "num_attention_heads")
        kwargs: dict[str, Any] = dict(
            hidden_size=int_key(d, "hidden_size"),
            num_hidden_layers=int_key(d, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=int_key(d, "num_key_value_heads", heads),
            intermediate_size=int_key(d, "intermediate_size"),
            vocab_size=int_key(d, "vocab_size"),
            max_position_embeddings=int_key(d, "max_position_embeddings", 32768),
            rope_theta=float_key(d, "rope_theta", 1_000_000.0),
            rms_norm_eps=float_key(d, "rms_norm_eps", 1e-6),
        )
        tie = d.get("tie_word_embeddings", True)
        if not isinstance(tie, bool):
            raise fail(f"tie_word_embeddings must be true or false, got {tie!r}")
        kwargs["tie_word_embeddings"] = tie

        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise fail(f"hidden_act={act!r} is not supported (Qwen2 uses 'silu')")
        if d.get("rope_scaling") not in (None, {}):
            raise fail(f"rope_scaling={d.get('rope_scaling')!r} is not supported (plain RoPE only)")

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
        kwargs.update(
            action_dims=dims,
            action_names=tuple(names),
            action_q01=tuple(float(x) for x in q01),
            action_q99=tuple(float(x) for x in q99),
            n_action_bins=int_key(vla, "n_action_bins", 256, lo=2),
            patch_grid=(int(grid[0]), int(grid[1])),
            patch_size=int_key(vla, "patch_size", 16),
            source=source,
        )
        cfg = cls(**kwargs)
        cfg._validate(fail, d)
        return cfg

    def _validate(self, fail, d: Mapping[str, Any]) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise fail(f"num_attention_heads={self.num_attention_heads} does not divide "
                       f"hidden_size={self.hidden_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise fail(f"num_key_value_heads={self.num_key_value_heads} does not divide "
                       f"num_attention_heads={self.num_attention_heads}")
        if self.head_dim % 2:
            raise fail(f"head_dim={self.head_dim} (hidden_size / num_attention_heads) must be even for RoPE")
        if "head_dim" in d and d["head_dim"] != self.head_dim:
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
                                      "patch_grid", "patch_size")}
        vla = {k: list(v) if isinstance(v, tuple) else v for k, v in vla.items()}
        d.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu", vla=vla)
        return d


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
    """Geometry of the embedded tiny default checkpoint (see engine/tiny_default.py)."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "hidden_size": 256,
        "num_hidden_layers": 4,
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
