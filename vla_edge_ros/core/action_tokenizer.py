"""OpenVLA-style action (de-)tokenisation: 256 uniform bins over [-1, 1], then q01/q99 un-normalisation.

The last ``n_bins`` vocabulary rows are the action bins: token id ``t`` -> bin ``t - (vocab_size - n_bins)``.
Bin ``b`` covers [-1 + b*w, -1 + (b+1)*w) with w = 2 / n_bins and decodes to its centre
``x = -1 + (b + 0.5) * w``; each dimension is then un-normalised

    a = 0.5 * (x + 1) * (q99 - q01) + q01

(OpenVLA's BOUNDS_Q99 scheme). Differences from OpenVLA's own tokenizer, on purpose: ids count up from the
first action row instead of down from the vocabulary end, and there are exactly ``n_bins`` centres (OpenVLA
uses 256 edges and 255 centres). A dimension with q01 == q99 is constant and decodes to q01.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


class ActionTokenizer:
    def __init__(self, vocab_size: int, q01: Sequence[float], q99: Sequence[float], n_bins: int = 256):
        q01 = np.asarray(q01, dtype=np.float64).reshape(-1)
        q99 = np.asarray(q99, dtype=np.float64).reshape(-1)
        if q01.shape != q99.shape or q01.size == 0:
            raise ValueError(f"q01 and q99 must be equally long non-empty vectors, got {q01.shape} and {q99.shape}")
        if not (np.all(np.isfinite(q01)) and np.all(np.isfinite(q99))):
            raise ValueError("q01 / q99 must be finite")
        if np.any(q01 > q99):
            raise ValueError(f"q01 must be <= q99 in every dimension: q01={q01.tolist()}, q99={q99.tolist()}")
        if n_bins < 2 or vocab_size < n_bins:
            raise ValueError(f"need 2 <= n_bins <= vocab_size, got n_bins={n_bins}, vocab_size={vocab_size}")
        self.vocab_size = int(vocab_size)
        self.n_bins = int(n_bins)
        self.offset = self.vocab_size - self.n_bins  # id of bin 0
        self.q01, self.q99 = q01, q99
        self.action_dims = q01.size
        self.bin_width = 2.0 / self.n_bins
        self.bin_centers = -1.0 + (np.arange(self.n_bins) + 0.5) * self.bin_width

    # ---- decoding (what the engine uses) -------------------------------------------------------------------
    def bins_from_token_ids(self, token_ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(token_ids, dtype=np.int64)
        bins = ids - self.offset
        bad = (bins < 0) | (bins >= self.n_bins)
        if np.any(bad):
            raise ValueError(f"token id(s) {ids[bad].tolist()} are not action tokens "
                             f"(action ids are {self.offset}..{self.vocab_size - 1})")
        return bins

    def bins_to_normalized(self, bins: np.ndarray) -> np.ndarray:
        b = np.asarray(bins, dtype=np.int64)
        if np.any((b < 0) | (b >= self.n_bins)):
            raise ValueError(f"action bins must lie in [0, {self.n_bins}), got {b.tolist()}")
        return self.bin_centers[b]

    def unnormalize(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        self._check_dims(x)
        return 0.5 * (x + 1.0) * (self.q99 - self.q01) + self.q01

    def bins_to_action(self, bins: np.ndarray) -> np.ndarray:
        """(action_dims,) bins -> (action_dims,) float32 un-normalised action."""
        return self.unnormalize(self.bins_to_normalized(bins)).astype(np.float32)

    def detokenize(self, token_ids: np.ndarray) -> np.ndarray:
        """(action_dims,) vocabulary ids -> (action_dims,) float32 un-normalised action."""
        return self.bins_to_action(self.bins_from_token_ids(token_ids))

    # ---- encoding (tests, data tools) ------------------------------------------------------------------------
    def normalize(self, action: np.ndarray) -> np.ndarray:
        a = np.asarray(action, dtype=np.float64)
        self._check_dims(a)
        span = self.q99 - self.q01
        safe = np.where(span > 0, span, 1.0)
        x = np.where(span > 0, 2.0 * (a - self.q01) / safe - 1.0, 0.0)
        return np.clip(x, -1.0, 1.0)

    def action_to_bins(self, action: np.ndarray) -> np.ndarray:
        x = self.normalize(action)
        return np.clip(np.floor((x + 1.0) / self.bin_width), 0, self.n_bins - 1).astype(np.int64)

    def tokenize(self, action: np.ndarray) -> np.ndarray:
        """(action_dims,) action -> vocabulary ids (values beyond q01/q99 saturate at the end bins)."""
        return self.action_to_bins(action) + self.offset

    def _check_dims(self, x: np.ndarray) -> None:
        if x.shape[-1:] != (self.action_dims,):
            raise ValueError(f"expected {self.action_dims} action dimensions, got shape {x.shape}")


def from_config(cfg) -> ActionTokenizer:
    """Tokenizer for a :class:`vla_edge_ros.engine.config.ModelConfig`."""
    return ActionTokenizer(cfg.vocab_size, cfg.action_q01, cfg.action_q99, cfg.n_action_bins)
