"""Rotary position embedding, HF Qwen2 convention (``rotate_half`` over the two halves of each head).

    inv_freq[j] = theta ** (-2j / head_dim),  j = 0 .. head_dim/2 - 1
    angle[p, :] = p * concat(inv_freq, inv_freq)
    rope(x, p)  = x * cos(angle[p]) + rotate_half(x) * sin(angle[p]),   rotate_half(x) = concat(-x2, x1)

Angles are computed in float64 from exact integer positions, then cast, so a table entry does not depend on
how large the position is or on how often it was recomputed (no drift).
"""
from __future__ import annotations

import numpy as np


def inv_freq(head_dim: int, theta: float) -> np.ndarray:
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    return 1.0 / (float(theta) ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))


def rope_tables(positions: np.ndarray, head_dim: int, theta: float,
                dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin tables of shape (len(positions), head_dim) for integer ``positions``."""
    pos = np.asarray(positions, dtype=np.float64).reshape(-1)
    ang = pos[:, None] * inv_freq(head_dim, theta)[None, :]
    ang = np.concatenate([ang, ang], axis=1)
    return np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)


def rotate_half(x: np.ndarray) -> np.ndarray:
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def apply_rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Rotate ``x`` of shape (n, heads, head_dim) (or (n, head_dim)) at integer ``positions`` (n,).

    Computed in the dtype of ``x`` with tables of that dtype (float64 input -> float64 maths).
    """
    x = np.asarray(x)
    dtype = x.dtype if x.dtype in (np.float32, np.float64) else np.float64
    cos, sin = rope_tables(positions, x.shape[-1], theta, dtype=dtype)
    if x.ndim == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    elif x.ndim != 2:
        raise ValueError(f"apply_rope expects (n, heads, head_dim) or (n, head_dim), got shape {x.shape}")
    return x * cos + rotate_half(x) * sin


class RopeTable:
    """Precomputed float32 tables for positions 0 .. n_positions-1, applied without temporaries.

    ``sin_signed`` holds -sin in the first half and +sin in the second, so
    rope(x) = x * cos + swap_halves(x) * sin_signed.
    """

    def __init__(self, n_positions: int, head_dim: int, theta: float):
        self.n_positions = int(n_positions)
        self.head_dim = head_dim
        self.theta = float(theta)
        self.cos, sin = rope_tables(np.arange(self.n_positions), head_dim, theta, np.float32)
        h = head_dim // 2
        self.sin_signed = sin.copy()
        self.sin_signed[:, :h] *= -1.0

    def apply(self, x: np.ndarray, positions: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """x (n, heads, head_dim) float32 at ``positions`` (n,) -> rotated (into ``out`` when given)."""
        pos = np.asarray(positions)
        if pos.size and (pos.min() < 0 or pos.max() >= self.n_positions):
            raise ValueError(f"RoPE position out of the table range [0, {self.n_positions}): "
                             f"{int(pos.min())}..{int(pos.max())}")
        cos = self.cos[pos][:, None, :]
        sin = self.sin_signed[pos][:, None, :]
        return self.apply_tables(x, cos, sin, out)

    @staticmethod
    def apply_tables(x: np.ndarray, cos: np.ndarray, sin_signed: np.ndarray,
                     out: np.ndarray | None = None) -> np.ndarray:
        h = x.shape[-1] // 2
        if out is None:
            out = np.empty(x.shape, dtype=np.float32)
        tmp = np.empty(x.shape, dtype=np.float32)
        np.multiply(x[..., h:], sin_signed[..., :h], out=tmp[..., :h])
        np.multiply(x[..., :h], sin_signed[..., h:], out=tmp[..., h:])
        np.multiply(x, cos, out=out)
        out += tmp
        return out
