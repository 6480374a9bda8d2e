"""What a chunk's shape must agree on, checked in one place for the factory and for both backends.

A chunk is the instruction prefix, ``tokens_per_frame`` vision tokens per retained frame and ``decode_tokens``
greedy steps. Three numbers come from the operator (parameters), the rest from the checkpoint's config.json, and
they must fit together: one frame is exactly the patch embedder's tokens, every action dimension gets a decode
step, the KV manager pins exactly the instruction's tokens, and no position reaches ``max_position_embeddings``.
``make_engine`` checks the parameters before it loads anything (a clear error instead of a half-built engine);
each backend checks again what it is handed, because tests, benchmarks and tools build backends directly. The
messages name the parameter, its value and what the model needs, so that one line tells an operator what to
change. Weight shapes are checked by ``engine.checkpoint`` (it owns the table of tensor names and shapes).
"""
from __future__ import annotations

import numpy as np

from vla_edge_ros.engine.config import ModelConfig
from vla_edge_ros.engine.interface import EngineError


def prefix_token_ids(instruction: str) -> np.ndarray:
    """Instruction -> UTF-8 bytes -> token ids (byte b -> id b)."""
    return np.frombuffer(instruction.encode("utf-8"), dtype=np.uint8).astype(np.int64)


def check_tokens_per_frame(cfg: ModelConfig, tokens_per_frame: int) -> None:
    """One frame is exactly the patch embedder's tokens (its patch grid)."""
    if tokens_per_frame != cfg.n_patches:
        raise EngineError(f"tokens_per_frame={tokens_per_frame} must equal the patch embedder's {cfg.n_patches} "
                          f"tokens (patch_grid {list(cfg.patch_grid)} of {cfg.source})")


def check_decode_tokens(cfg: ModelConfig, decode_tokens: int) -> None:
    """At least one greedy decode step per action dimension."""
    if decode_tokens < cfg.action_dims:
        raise EngineError(f"decode_tokens={decode_tokens} is smaller than the model's {cfg.action_dims} action "
                          "dimensions (one decode step per dimension)")


def check_positions(cfg: ModelConfig, kv_budget_tokens: int, decode_tokens: int) -> None:
    """Every logical position of a chunk (context slots, then the decode steps) stays below
    max_position_embeddings: the model was not trained past it."""
    if cfg.max_position_embeddings <= kv_budget_tokens + decode_tokens:
        raise EngineError(f"kv_budget_tokens={kv_budget_tokens} + decode_tokens={decode_tokens} must stay below "
                          f"max_position_embeddings={cfg.max_position_embeddings} of {cfg.source}")


def check_prefix(prefix_tokens: int, instruction: str) -> np.ndarray:
    """The KV manager pins exactly the instruction's tokens; returns those token ids."""
    ids = prefix_token_ids(instruction)
    if prefix_tokens != len(ids):
        raise EngineError(f"KV manager pins {prefix_tokens} prefix tokens but the instruction encodes to "
                          f"{len(ids)} bytes")
    return ids


def check_chunk_geometry(cfg: ModelConfig, kv, instruction: str, decode_tokens: int) -> np.ndarray:
    """What a backend checks before it allocates anything, for the KV manager ``kv`` it is handed (its
    tokens_per_frame, prefix_tokens and budget_tokens); returns the instruction's token ids."""
    check_decode_tokens(cfg, decode_tokens)
    check_tokens_per_frame(cfg, kv.tokens_per_frame)
    ids = check_prefix(kv.prefix_tokens, instruction)
    check_positions(cfg, int(kv.budget_tokens), decode_tokens)
    return ids
