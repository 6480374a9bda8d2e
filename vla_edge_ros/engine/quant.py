"""Weight quantisation (issue 23): int8 / fp8 e4m3 / int4 codes, their scales, and the exact dequantise step.

Why this file exists: the GPU kernels dequantise in registers inside their GEMV / skinny-GEMM loops, and the numpy
backend is the oracle they are tested against. That only works if "dequantise" means one thing, bit for bit, on
both sides, so it is defined here once, in plain numpy, as float32 operations a CUDA kernel can repeat exactly:

    int8  (W8A16)   w' = float32(q) * s[row]                 q int8 in [-127, 127], s float32 per output row
    fp8   (e4m3fn)  w' = e4m3_value(q) * s[row]              q uint8 bit pattern (no NaN code), s float32 per row
    int4  (W4A16)   w' = float32(q - z[row, k // 128]) * s[row, k // 128]
                                                             q, z in [0, 15]; two codes per byte, element 2j in
                                                             the LOW nibble of byte j, 2j+1 in the high nibble
    bf16            w' = float32(bits << 16)                 the unquantised baseline, same container

Each w' is ONE correctly rounded float32 multiply of two exactly representable operands (an integer code, an
e4m3 value, a small integer difference), so `__int2float_rn(q) * s` (or `__half2float(e4m3 -> half)` * s) in a
kernel gives identical bits. What is NOT bit-exact is the dot product after it: its float32 accumulation order
is the kernel's business, and a kernel that factors the per-row scale out of the sum (exact in real
arithmetic) differs from ``matmul`` here by accumulation rounding only; compare those with a tolerance.

Choices (docs/QUANTIZATION.md says more):
- scales are float32, not bf16: a bf16 scale is one more rounding the codes were not computed against (the
  largest weight would no longer land on +-127 / +-448 / the range ends), and the saving is small: 4 bytes per
  output row for int8/fp8 (< 0.3 % of a 1536-wide row), 4 bytes per 64 bytes of int4 codes.
- int8 and fp8 are symmetric per OUTPUT channel (one scale per row of W (out, in)): a GEMV thread block owns
  whole rows, so its scale is one register; int8 never uses -128 so the range is symmetric.
- int4 is asymmetric (min/max with an integer zero point) in groups of 128 along the INPUT dimension: 16 levels
  instead of 15 and no level wasted on a side the group does not use; the range always includes 0, so the zero
  point is an integer in [0, 15] and the error stays <= s / 2. 128 = 64 bytes of codes, one aligned
  four-16-byte-load span per group; every Qwen2 width (896, 1536, 4864, 8960...) is a multiple of it. A last
  group shorter than 128 (the tiny default's intermediate 704) uses its own elements.

Codes are computed on the host in float32: q = rint(w / s) with IEEE division and round-half-even (np.rint), so
a GPU quantiser using __fdiv_rn and __float2int_rn gets the same codes. Non-finite weights are refused.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from vla_edge_ros.engine.checkpoint import bf16_bits_to_f32, f32_to_bf16_bits

WEIGHT_DTYPES = ("bf16", "int8", "fp8", "int4")
GROUP_SIZE = 128  # int4 group along the input dimension
INT8_MAX = 127
INT4_LEVELS = 15  # codes 0..15
E4M3_MAX = 448.0  # largest finite e4m3fn value (S.1111.110); S.1111.111 is NaN, there is no infinity

# layout names: what a checkpoint and a kernel agree on (bump the name when the arithmetic changes)
LAYOUTS = {"bf16": "bf16",
           "int8": "int8-sym-per-row-f32scale",
           "fp8": "fp8-e4m3fn-per-row-f32scale",
           "int4": "int4-asym-g128-lownibble-f32scale-u8zero"}

# the linear layers issue 23 quantises; embedding, norms, biases, vision and the LM head stay as they are
LINEAR_NAME = re.compile(r"^model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)\.weight$")


def is_quantized_name(name: str) -> bool:
    """True for the q/k/v/o and gate/up/down weight matrices of a decoder layer."""
    return LINEAR_NAME.match(name) is not None


def _finite_matrix(w, what: str) -> np.ndarray:
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim != 2 or 0 in w.shape:
        raise ValueError(f"{what}: a linear weight must be a non-empty 2-D (out, in) matrix, got shape {w.shape}")
    if not np.all(np.isfinite(w)):
        raise ValueError(f"{what}: non-finite weight(s) ({int((~np.isfinite(w)).sum())} of {w.size}); "
                         "refusing to quantise")
    return w


# ---- fp8 e4m3fn ------------------------------------------------------------------------------------------------

def _e4m3_table() -> np.ndarray:
    """float32 value of each of the 256 codes: sign bit 7, exponent bits 6..3 (bias 7), mantissa bits 2..0."""
    c = np.arange(256)
    e, m = (c >> 3) & 0xF, c & 0x7
    mag = np.where(e == 0, np.ldexp(m.astype(np.float64), -9), np.ldexp((8 + m).astype(np.float64), e - 10))
    val = np.where(c & 0x80, -mag, mag)
    val[(c & 0x7F) == 0x7F] = np.nan  # 0x7F, 0xFF: the only NaNs; e4m3fn has no infinity
    return val.astype(np.float32)


E4M3_VALUES = _e4m3_table()
E4M3_VALUES.setflags(write=False)


def e4m3_decode(codes) -> np.ndarray:
    """uint8 e4m3fn bit patterns -> float32 (exact: every e4m3 value is a float32; NaN codes give NaN)."""
    codes = np.asarray(codes)
    if codes.dtype != np.uint8:
        raise ValueError(f"e4m3_decode: codes must be uint8 bit patterns, got {codes.dtype}")
    return E4M3_VALUES[codes]


def e4m3_encode(x) -> np.ndarray:
    """float32 -> uint8 e4m3fn bit patterns: round to nearest, ties to even, saturating at +-448 (as CUDA's
    __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)); never produces the NaN code. NaN input is refused.

    Normal range (|x| >= 2^-6): the float32 exponent is re-biased (127 -> 7) and the 23-bit mantissa rounded to
    3 bits on its bits; a mantissa carry rolls into the exponent, as the code layout makes it do. Subnormal range:
    the code IS rint(|x| * 2^9) (0..8; 8 is the smallest normal, 2^-6, with the same bits).
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    if np.isnan(x).any():
        raise ValueError("e4m3_encode: NaN input (no finite e4m3 code represents it)")
    sign = ((x.view(np.uint32) >> 24) & 0x80).astype(np.int32)
    a = np.abs(x)
    abits = a.view(np.uint32)
    exp = (abits >> 23).astype(np.int32) - 127
    man = (abits & 0x7FFFFF).astype(np.int32)
    keep, rest = man >> 20, man & 0xFFFFF  # 3 kept mantissa bits, 20 dropped
    up = (rest > 0x80000) | ((rest == 0x80000) & ((keep & 1) == 1))  # round half to even
    with np.errstate(over="ignore", invalid="ignore"):
        normal = ((exp + 7) << 3) + keep + up.astype(np.int32)
        sub = np.rint(a * np.float32(512.0)).astype(np.int32)
    code = np.where(a < np.float32(2.0 ** -6), sub, normal)
    code = np.where(a >= np.float32(E4M3_MAX), 0x7E, np.minimum(code, 0x7E))  # saturate (also +-inf)
    return (code | sign).astype(np.uint8)


# ---- int4 packing ----------------------------------------------------------------------------------------------

def pack_int4(q) -> np.ndarray:
    """(out, K) codes in [0, 15] -> (out, ceil(K / 2)) uint8: element 2j in the low nibble of byte j, element
    2j + 1 in the high nibble; an odd K leaves the last high nibble 0."""
    q = np.asarray(q)
    if q.ndim != 2 or q.dtype.kind not in "iu" or q.size and (q.min() < 0 or q.max() > 15):
        raise ValueError("pack_int4: codes must be a 2-D integer array in [0, 15]")
    q = q.astype(np.uint8)
    if q.shape[1] % 2:
        q = np.concatenate([q, np.zeros((q.shape[0], 1), np.uint8)], axis=1)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)


def unpack_int4(packed, k: int) -> np.ndarray:
    """(out, ceil(k / 2)) uint8 -> (out, k) uint8 codes in [0, 15] (inverse of pack_int4)."""
    packed = np.asarray(packed)
    if packed.dtype != np.uint8 or packed.ndim != 2 or packed.shape[1] != (k + 1) // 2:
        raise ValueError(f"unpack_int4: expected uint8 (out, {(k + 1) // 2}), got {packed.dtype} {packed.shape}")
    q = np.empty((packed.shape[0], 2 * packed.shape[1]), np.uint8)
    q[:, 0::2], q[:, 1::2] = packed & 0xF, packed >> 4
    return q[:, :k]


# ---- the container ---------------------------------------------------------------------------------------------

def quantized_nbytes(shape: tuple[int, int], weight_dtype: str, group_size: int = GROUP_SIZE) -> int:
    """Bytes one (out, in) linear weight takes in ``weight_dtype`` (codes + scales + zeros): what the VRAM check
    counts, without quantising anything."""
    out, k = shape
    if weight_dtype == "bf16":
        return 2 * out * k
    if weight_dtype in ("int8", "fp8"):
        return out * k + 4 * out
    if weight_dtype == "int4":
        return out * ((k + 1) // 2) + out * math.ceil(k / group_size) * (4 + 1)
    raise ValueError(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {weight_dtype!r}")


def fit_advice(weight_dtype: str, shape: tuple[int, int] = (1536, 1536)) -> str:
    """The weight-type part of the advice when a chunk cannot fit its deadline (the runtime's start-up deadline_fit
    warning): batch-1 decoding reads every linear weight once per pass, so a smaller type reads fewer bytes. Names
    the smaller types with their bytes relative to ``weight_dtype`` (for a ``shape`` weight: the scales included)."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {weight_dtype!r}")
    mine = quantized_nbytes(shape, weight_dtype)
    smaller = [(wd, quantized_nbytes(shape, wd) / mine) for wd in WEIGHT_DTYPES if quantized_nbytes(shape, wd) < mine]
    if not smaller:
        return f"weight_dtype {weight_dtype} is already the smallest type"
    return (f"weights smaller than {weight_dtype} (weight_dtype " + ", ".join(f"{wd}: {r:.2f}x the bytes"
                                                                           for wd, r in smaller) + ")")


def weights_nbytes(shapes: Mapping[str, tuple[int, ...]], weight_dtype: str, group_size: int = GROUP_SIZE,
                   dense_bytes_per_element: int = 2) -> int:
    """Bytes a device holds for tensors ``shapes`` (name -> shape): the quantised linear layers
    (``is_quantized_name``) in ``weight_dtype``, every other tensor at ``dense_bytes_per_element`` (bf16). The one
    count the start-up memory checks use (the numpy backend's figure, the CUDA plan via engine/cuda/vram.py);
    equals ``quantize_weights(tensors, weight_dtype).total_bytes()`` for tensors of those shapes."""
    total = 0
    for name, shape in shapes.items():
        if is_quantized_name(name):
            total += quantized_nbytes(tuple(shape), weight_dtype, group_size)
        else:
            total += math.prod(shape) * dense_bytes_per_element
    return total


def linear_shapes(cfg, intermediate_size: int | None = None) -> dict[str, tuple[int, int]]:
    """The (out, in) shape of every quantised linear weight of a Qwen2 ``cfg`` (engine.config.ModelConfig), by HF
    name. ``intermediate_size``: a padded width a backend lays its MLP out with (default the config's)."""
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    inter = cfg.intermediate_size if intermediate_size is None else int(intermediate_size)
    per_layer = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                 "self_attn.o_proj": (h, q), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
                 "mlp.down_proj": (h, inter)}
    return {f"model.layers.{i}.{n}.weight": s for i in range(cfg.num_hidden_layers) for n, s in per_layer.items()}


@dataclass(frozen=True, eq=False)
class QuantizedLinear:
    """One linear weight W (out, in) in one layout: ``codes`` (+ ``scales``, ``zeros``), checked on construction
    so a container that exists is one a kernel can dequantise (what a checkpoint reader relies on)."""
    weight_dtype: str
    codes: np.ndarray  # uint16 bf16 bits / int8 / uint8 e4m3 bits: (out, in); int4: uint8 (out, ceil(in / 2))
    scales: np.ndarray | None  # float32: (out,) for int8 / fp8; (out, groups) for int4; None for bf16
    shape: tuple[int, int]  # (out_features, in_features) of the original matrix
    zeros: np.ndarray | None = None  # int4 only: uint8 (out, groups) in [0, 15]
    group_size: int | None = None  # int4 only

    def __post_init__(self):
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {self.weight_dtype!r}")
        if (len(self.shape) != 2 or not all(isinstance(n, (int, np.integer)) and n > 0 for n in self.shape)):
            raise ValueError(f"shape must be (out, in) positive integers, got {self.shape!r}")
        out, k = (int(n) for n in self.shape)
        object.__setattr__(self, "shape", (out, k))
        wd = self.weight_dtype
        groups = None
        if wd == "int4":
            gs = self.group_size
            if not isinstance(gs, int) or gs < 2 or gs % 2:
                raise ValueError(f"int4: group_size must be a positive even integer, got {gs!r}")
            groups = math.ceil(k / gs)
        elif self.group_size is not None:
            raise ValueError(f"{wd}: group_size must be None (per-row scales), got {self.group_size!r}")
        code_spec = {"bf16": (np.uint16, (out, k)), "int8": (np.int8, (out, k)), "fp8": (np.uint8, (out, k)),
                     "int4": (np.uint8, (out, (k + 1) // 2))}[wd]
        self._check("codes", self.codes, *code_spec)
        if wd == "bf16":
            if self.scales is not None or self.zeros is not None:
                raise ValueError("bf16: no scales or zeros")
            return
        self._check("scales", self.scales, np.float32, (out,) if groups is None else (out, groups))
        if not np.all(np.isfinite(self.scales)) or (self.scales < 0).any():
            raise ValueError(f"{wd}: scales must be finite and >= 0")
        if wd == "int8" and (self.codes == -128).any():
            raise ValueError("int8: code -128 found; this layout is symmetric, codes in [-127, 127]")
        if wd == "fp8" and ((self.codes & 0x7F) == 0x7F).any():
            raise ValueError("fp8: NaN code (0x7F / 0xFF) found; the quantiser saturates, it never writes NaN")
        if wd == "int4":
            self._check("zeros", self.zeros, np.uint8, (out, groups))
            if (self.zeros > INT4_LEVELS).any():
                raise ValueError("int4: zero points must be in [0, 15]")
            if k % 2 and (self.codes[:, -1] >> 4).any():
                raise ValueError(f"int4: in_features={k} is odd but the padding nibble of some row is not 0")
        elif self.zeros is not None:
            raise ValueError(f"{wd}: symmetric layout, zeros must be None")

    def _check(self, what: str, a, dtype, shape) -> None:
        if not isinstance(a, np.ndarray) or a.dtype != np.dtype(dtype) or a.shape != shape:
            got = f"{a.dtype} {list(a.shape)}" if isinstance(a, np.ndarray) else type(a).__name__
            raise ValueError(f"{self.weight_dtype}: {what} must be {np.dtype(dtype)} {list(shape)}, got {got}")

    @property
    def layout(self) -> str:
        return LAYOUTS[self.weight_dtype]

    def dequantize(self) -> np.ndarray:
        """W' (out, in) float32, each element one float32 multiply (module docstring): the bits a kernel makes."""
        out, k = self.shape
        if self.weight_dtype == "bf16":
            return bf16_bits_to_f32(self.codes)
        if self.weight_dtype == "int8":
            return self.codes.astype(np.float32) * self.scales[:, None]
        if self.weight_dtype == "fp8":
            return e4m3_decode(self.codes) * self.scales[:, None]
        g = np.arange(k) // self.group_size  # group of each input column
        q = unpack_int4(self.codes, k).astype(np.int16) - self.zeros[:, g].astype(np.int16)  # exact, [-15, 15]
        return q.astype(np.float32) * self.scales[:, g]

    def matmul(self, x) -> np.ndarray:
        """x (..., in) -> x @ W'.T (..., out) in float32: the oracle the kernels' GEMVs are compared with."""
        x = np.asarray(x, dtype=np.float32)
        if x.shape[-1] != self.shape[1]:
            raise ValueError(f"matmul: x has {x.shape[-1]} features, the weight takes {self.shape[1]}")
        return x @ self.dequantize().T

    def bytes(self) -> int:
        """Bytes of codes + scales + zeros (equals quantized_nbytes(shape, weight_dtype))."""
        return sum(a.nbytes for a in (self.codes, self.scales, self.zeros) if a is not None)


# ---- the quantisers --------------------------------------------------------------------------------------------

def _safe(scale: np.ndarray) -> np.ndarray:
    return np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)  # an all-zero row codes to 0


def row_scales(w: np.ndarray, weight_dtype: str) -> np.ndarray:
    """int8 / fp8: one float32 scale per output row, the row's largest |w| over the code's largest magnitude."""
    top = {"int8": np.float32(INT8_MAX), "fp8": np.float32(E4M3_MAX)}[weight_dtype]
    return (np.abs(w).max(axis=1) / top).astype(np.float32)


def int8_codes(x: np.ndarray, safe_scale: np.ndarray) -> np.ndarray:
    """q = clip(rint(x / s), -127, 127) in float32 (``safe_scale``: zero scales replaced by 1, see _safe)."""
    return np.clip(np.rint(x / safe_scale), -INT8_MAX, INT8_MAX)


def int4_scale_zero(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A group's range [lo, hi] (lo <= 0 <= hi, float32) -> (s, z): s = (hi - lo) / 15, z = rint(-lo / s) in
    [0, 15], both float32 (z integral)."""
    s = ((hi - lo) / np.float32(INT4_LEVELS)).astype(np.float32)
    return s, np.clip(np.rint(-lo / _safe(s)), 0, INT4_LEVELS).astype(np.float32)


def int4_codes(x: np.ndarray, s: np.ndarray, z: np.ndarray) -> np.ndarray:
    """q = clip(rint(x / s) + z, 0, 15) in float32, s and z broadcast against x."""
    return np.clip(np.rint(x / _safe(s)) + z, 0, INT4_LEVELS)


def quantize_bf16(w) -> QuantizedLinear:
    w = _finite_matrix(w, "bf16")
    return QuantizedLinear("bf16", f32_to_bf16_bits(w), None, w.shape)


def quantize_int8(w) -> QuantizedLinear:
    """Symmetric per output row: s = max|w_row| / 127, q = rint(w / s) (float32), in [-127, 127]."""
    w = _finite_matrix(w, "int8")
    s = row_scales(w, "int8")
    q = int8_codes(w, _safe(s)[:, None]).astype(np.int8)
    return QuantizedLinear("int8", q, s, w.shape)


def quantize_fp8(w) -> QuantizedLinear:
    """e4m3fn per output row: s = max|w_row| / 448, q = e4m3_encode(w / s) (float32 division, RNE, saturating)."""
    w = _finite_matrix(w, "fp8")
    s = row_scales(w, "fp8")
    return QuantizedLinear("fp8", e4m3_encode(w / _safe(s)[:, None]), s, w.shape)


def quantize_int4(w, group_size: int = GROUP_SIZE) -> QuantizedLinear:
    """Asymmetric per group of ``group_size`` input columns: lo = min(0, min w), hi = max(0, max w),
    s = (hi - lo) / 15, z = rint(-lo / s) in [0, 15], q = clip(rint(w / s) + z, 0, 15), all float32."""
    w = _finite_matrix(w, "int4")
    if not isinstance(group_size, int) or group_size < 2 or group_size % 2:
        raise ValueError(f"int4: group_size must be a positive even integer, got {group_size!r}")
    out, k = w.shape
    groups = math.ceil(k / group_size)
    padded = np.zeros((out, groups * group_size), np.float32)  # zero padding: the range includes 0 anyway
    padded[:, :k] = w
    g = padded.reshape(out, groups, group_size)
    lo, hi = np.minimum(g.min(axis=2), 0).astype(np.float32), np.maximum(g.max(axis=2), 0).astype(np.float32)
    s, z = int4_scale_zero(lo, hi)
    q = int4_codes(g, s[:, :, None], z[:, :, None]).astype(np.uint8)
    return QuantizedLinear("int4", pack_int4(q.reshape(out, -1)[:, :k]), s, (out, k), z.astype(np.uint8),
                           group_size)


def quantize_linear(w, weight_dtype: str, group_size: int = GROUP_SIZE) -> QuantizedLinear:
    if weight_dtype == "int4":
        return quantize_int4(w, group_size)
    quantizers = {"bf16": quantize_bf16, "int8": quantize_int8, "fp8": quantize_fp8}
    if weight_dtype not in quantizers:
        raise ValueError(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {weight_dtype!r}")
    return quantizers[weight_dtype](w)


# ---- a whole model ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class QuantStats:
    max_abs_error: float  # max |W - W'|
    rel_frobenius_error: float  # ||W - W'||_F / ||W||_F (0 for an all-zero W)
    bytes: int  # of the quantised container
    bf16_bytes: int  # of the same matrix in bf16


def quant_stats(w, q: QuantizedLinear) -> QuantStats:
    w = np.asarray(w, dtype=np.float64)
    err = w - q.dequantize().astype(np.float64)
    norm = float(np.linalg.norm(w))
    return QuantStats(float(np.abs(err).max()), float(np.linalg.norm(err) / norm) if norm else 0.0,
                      q.bytes(), 2 * w.size)


@dataclass(eq=False)
class QuantizedModel:
    """A checkpoint's tensors with its linear layers quantised: ``linear`` (name -> QuantizedLinear), ``dense``
    (every other tensor, float32 as given), ``stats`` (per quantised tensor; empty when read from a
    pre-quantised checkpoint, whose originals are gone)."""
    weight_dtype: str
    linear: dict[str, QuantizedLinear]
    dense: dict[str, np.ndarray]
    group_size: int | None = None
    stats: dict[str, QuantStats] = field(default_factory=dict)

    def dequantized(self) -> dict[str, np.ndarray]:
        """Every tensor by name as float32, linear weights dequantised: what the reference forward can take."""
        return {**self.dense, **{n: q.dequantize() for n, q in self.linear.items()}}

    def linear_bytes(self) -> int:
        return sum(q.bytes() for q in self.linear.values())

    def dense_bytes(self, bytes_per_element: int = 2) -> int:
        """The unquantised tensors as the device holds them (bf16 by default)."""
        return sum(a.size for a in self.dense.values()) * bytes_per_element

    def total_bytes(self, dense_bytes_per_element: int = 2) -> int:
        return self.linear_bytes() + self.dense_bytes(dense_bytes_per_element)


def quantize_weights(tensors: Mapping[str, np.ndarray], weight_dtype: str,
                     group_size: int = GROUP_SIZE) -> QuantizedModel:
    """Quantise exactly the q/k/v/o and gate/up/down weights (``is_quantized_name``) of ``tensors`` (name -> array,
    float32 from a bf16 checkpoint); everything else passes through as float32. Per-tensor stats included."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {weight_dtype!r}")
    linear, dense, stats = {}, {}, {}
    for name, w in tensors.items():
        if is_quantized_name(name):
            try:
                linear[name] = quantize_linear(w, weight_dtype, group_size)
            except ValueError as exc:
                raise ValueError(f"tensor {name}: {exc}") from exc
            stats[name] = quant_stats(w, linear[name])
        else:
            dense[name] = np.asarray(w, dtype=np.float32)
    if not linear:
        raise ValueError("quantize_weights: no q/k/v/o or gate/up/down weight (model.layers.N.self_attn.*_proj / "
                         "mlp.*_proj) among the tensors; is this a Qwen2 checkpoint's dict?")
    return QuantizedModel(weight_dtype, linear, dense, group_size if weight_dtype == "int4" else None, stats)
