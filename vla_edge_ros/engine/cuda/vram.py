"""One tracker for every device allocation of the CUDA engine, the bytes a model, cache and chunk will take
(``memory_plan``), and the start-up VRAM budget check.

Every buffer the backend puts on the GPU goes through :meth:`VramTracker.alloc` (named, so a refusal or a leak
can be told apart), which keeps current and peak bytes. ``check_budget`` runs before the first allocation: the
node refuses to start with a message naming each part when model + KV budget + scratch would exceed
``max_vram_gb``; the model part counts the weights at their quantised size (``quantized_model_bytes``, issue
23). Imports without PyCUDA: the allocator is injected.
"""
from __future__ import annotations

import math
from typing import Any, Callable

from vla_edge_ros.engine.config import ModelConfig
from vla_edge_ros.engine.cuda.pass_meta import meta_ints, parallel_tiles, pass_tiles
from vla_edge_ros.engine.cuda.plan import T_CHUNK, LaunchConstants, padded_intermediate
from vla_edge_ros.engine.geometry import is_parallel
from vla_edge_ros.engine.interface import EngineError
from vla_edge_ros.engine.quant import linear_shapes, weights_nbytes

GIB = 1024 ** 3


def quantized_model_bytes(bf16_model_bytes: int, cfg, weight_dtype: str, intermediate_size: int) -> int:
    """The model part of the budget in ``weight_dtype``: ``bf16_model_bytes`` (``memory_plan``'s, every linear
    weight in bf16 with the MLP padded to ``intermediate_size``) with those linear weights counted at their
    quantised size (engine/quant.weights_nbytes, the numpy backend's count too). bf16 returns it unchanged."""
    shapes = linear_shapes(cfg, intermediate_size)
    return int(bf16_model_bytes - weights_nbytes(shapes, "bf16") + weights_nbytes(shapes, weight_dtype))


def check_budget(model_bytes: int, kv_bytes: int, scratch_bytes: int, max_vram_gb: float) -> int:
    """Raise EngineError when the three parts exceed ``max_vram_gb`` GiB; return the total bytes otherwise."""
    parts = {"model": model_bytes, "kv": kv_bytes, "scratch": scratch_bytes}
    for name, b in parts.items():
        if not isinstance(b, int) or isinstance(b, bool) or b < 0:
            raise EngineError(f"check_budget: {name}_bytes must be a non-negative integer, got {b!r}")
    if not isinstance(max_vram_gb, (int, float)) or isinstance(max_vram_gb, bool) or not max_vram_gb > 0:
        raise EngineError(f"check_budget: max_vram_gb must be a positive number, got {max_vram_gb!r}")
    total = model_bytes + kv_bytes + scratch_bytes
    limit = int(max_vram_gb * GIB)
    if total > limit:
        raise EngineError(
            f"refusing to start: the CUDA backend needs {total / GIB:.3f} GiB of device memory "
            f"(model {model_bytes / GIB:.3f} + KV cache {kv_bytes / GIB:.3f} + scratch {scratch_bytes / GIB:.3f}) "
            f"but max_vram_gb={max_vram_gb}. Raise max_vram_gb, lower kv_budget_tokens, or use a smaller model")
    return total


class VramTracker:
    """Named device allocations with current / peak byte counts.

    ``alloc_fn(nbytes) -> handle`` allocates (``pycuda.driver.mem_alloc`` on the GPU); ``free_fn(handle)`` frees
    (``handle.free()`` by default). ``limit_bytes`` (optional) makes an allocation that would pass it fail with
    an EngineError before it reaches the driver.
    """

    def __init__(self, alloc_fn: Callable[[int], Any], free_fn: Callable[[Any], None] | None = None,
                 limit_bytes: int | None = None):
        self._alloc_fn = alloc_fn
        self._free_fn = free_fn or (lambda h: h.free())
        self.limit_bytes = limit_bytes
        self._live: dict[str, tuple[Any, int]] = {}
        self.current_bytes = 0
        self.peak_bytes = 0

    def alloc(self, name: str, nbytes: int) -> Any:
        if name in self._live:
            raise EngineError(f"device allocation {name!r} already exists (free it first)")
        nbytes = int(nbytes)
        if nbytes <= 0:
            raise EngineError(f"device allocation {name!r}: size must be positive, got {nbytes}")
        if self.limit_bytes is not None and self.current_bytes + nbytes > self.limit_bytes:
            raise EngineError(f"device allocation {name!r} of {nbytes} bytes would bring the backend to "
                              f"{(self.current_bytes + nbytes) / GIB:.3f} GiB, over its limit of "
                              f"{self.limit_bytes / GIB:.3f} GiB (max_vram_gb)")
        try:
            handle = self._alloc_fn(nbytes)
        except Exception as exc:
            raise EngineError(f"device allocation {name!r} of {nbytes} bytes failed: {exc} "
                              f"(backend holds {self.current_bytes / GIB:.3f} GiB)") from exc
        self._live[name] = (handle, nbytes)
        self.current_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        return handle

    def free(self, name: str) -> None:
        handle, nbytes = self._live.pop(name)
        self._free_fn(handle)
        self.current_bytes -= nbytes

    def free_all(self) -> None:
        for name in list(self._live):
            self.free(name)

    def names(self) -> list[str]:
        return list(self._live)

    def stats(self) -> dict[str, int]:
        return {"current_bytes": int(self.current_bytes), "peak_bytes": int(self.peak_bytes),
                "allocations": len(self._live)}


def memory_plan(cfg: ModelConfig, capacity: int, scratch_slots: int,
                c: LaunchConstants = LaunchConstants()) -> dict[str, int]:
    """Bytes of model, KV cache and scratch for a KV capacity and a chunk's ``scratch_slots`` decode tokens
    (engine/geometry.chunk_scratch_slots: S autoregressive steps, or the A parallel slots; not the decode_tokens
    parameter): the three parts of vram.check_budget."""
    H, I, L, V = cfg.hidden_size, padded_intermediate(cfg), cfg.num_hidden_layers, cfg.vocab_size
    Hq, HD, nkv = cfg.num_attention_heads, cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    nqkv, n_bins, T = Hq * HD + 2 * nkv, cfg.n_action_bins, T_CHUNK * pass_tiles(cfg)  # the passes' rows
    per_layer = 2 * (nqkv * H + H * H + 2 * I * H + H * I + 2 * H) + 4 * nqkv
    model = L * per_layer + 2 * V * H + 2 * H + 2 * H * cfg.patch_dim + 4 * cfg.n_patches * H
    if not cfg.tie_word_embeddings:
        model += 2 * n_bins * H
    slots = capacity + scratch_slots
    kv = 2 * L * slots * nkv * 2
    n_split = math.ceil(slots / c.ATT_KC)
    scratch = (4 * T * (3 * H + nqkv) + 2 * T * (2 * H + I)
               + 4 * (n_split * Hq * T_CHUNK * (HD + 2)) + 4 * (n_split * Hq * (HD + 2))  # partials: one tile's
               + 4 * (3 * H + Hq * HD + I + scratch_slots * H)
               + 4 * (scratch_slots + 1) * n_bins + 8 * (slots + 64) * HD // 2
               + 4 * (slots + 8) + 4 * meta_ints(scratch_slots + 1, parallel_tiles(cfg))
               + 2 * T_CHUNK * cfg.patch_dim + 4096
               + (4 * T_CHUNK * parallel_tiles(cfg) * H if is_parallel(cfg) else 0))  # Weights.parallel_rows
    return {"model": int(model), "kv": int(kv), "scratch": int(scratch)}
