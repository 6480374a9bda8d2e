"""What a chunk's shape must agree on, checked in one place for the factory and for both backends.

A chunk is the instruction prefix, ``tokens_per_frame`` vision tokens per retained frame and its greedy decode
steps (``chunk_decode_steps``: ``decode_tokens`` in the seed shape). Three numbers come from the operator
(parameters), the rest from the checkpoint's config.json, and they must fit together: one frame is exactly the
patch embedder's tokens, every action dimension gets a decode step, the KV manager pins exactly the instruction's
tokens, and no position reaches ``max_position_embeddings``.
``make_engine`` checks the parameters before it loads anything (a clear error instead of a half-built engine);
each backend checks again what it is handed, because tests, benchmarks and tools build backends directly. The
messages name the parameter, its value and what the model needs, so that one line tells an operator what to
change. Weight shapes are checked by ``engine.checkpoint`` (it owns the table of tensor names and shapes).

The chunk's token layout (engine/interface.py's module docstring) is arithmetic every backend, the reference
and the factory need: how many decode passes a chunk runs (``chunk_decode_steps``, what the admission cost model
counts), how many scratch slots its decode tokens take (``chunk_scratch_slots``: they size buffers and the
position check), which greedy choices are the action bins (``action_token_slice``, ``chunk_bins``), the input of
a parallel slot (``parallel_slot_token``) and which choices a forced prefix fixes (``check_forced_bins``,
``forced_gen``). It is written here once so that the backends cannot drift apart.
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


def chunk_action_tokens(cfg: ModelConfig) -> int:
    """A = action_horizon * action_dims action tokens per chunk (time-major: step 0's bins, then step 1's, ...)."""
    return int(cfg.action_horizon) * int(cfg.action_dims)


PARALLEL = "parallel"  # vla.chunk_decode: every action slot in one pass (OpenVLA-OFT style)


def is_parallel(cfg: ModelConfig) -> bool:
    """Whether the checkpoint decodes its action slots in one parallel pass (else autoregressively)."""
    return getattr(cfg, "chunk_decode", "autoregressive") == PARALLEL


def parallel_slot_token(cfg: ModelConfig) -> int:
    """The input token id of every parallel action slot: bin 0's id, ``action_token_offset + 0`` (the START
    token the parallel training feeds at every slot; vla_edge_ros/train builds against this definition)."""
    return int(cfg.action_token_offset) + 0


def check_chunk_decode(cfg: ModelConfig) -> None:
    """Parallel decoding needs action_start "token": its A slots follow the prefill's start token (gen[0]), and
    with "prefill" the first bin would come from the prefill while the other slots could not see it."""
    if is_parallel(cfg) and cfg.action_start != "token":
        raise EngineError(f"vla.chunk_decode='parallel' with vla.action_start={cfg.action_start!r}: parallel "
                          "decoding needs action_start \"token\" (the A action slots follow the start token)")


def chunk_decode_steps(cfg: ModelConfig, decode_tokens: int) -> int:
    """S, the decode steps of one chunk (each feeds gen[i-1], yields gen[i]; gen[0] comes from the prefill).

    action_start "prefill": gen[0] is bin 1, so A - 1 steps whatever ``decode_tokens`` says. "token": gen[0] is
    the action-start token; with H = 1 the operator's ``decode_tokens`` steps (the seed behaviour, 8 = 7 bins and
    the end token, larger values decode further); with H > 1 at least A + 1 (the A bins and the end token: the
    training targets are [START, bins of steps t..t+H-1, END]).
    chunk_decode "parallel": 1. Its decode is ONE pass A slots wide; a pass reads every weight and the whole KV
    context once, like one autoregressive step, so the cost model (prefill + decode_steps x per-step cost) counts
    it as one step. Its scratch slots are A (``chunk_scratch_slots``), not S."""
    check_chunk_decode(cfg)
    a = chunk_action_tokens(cfg)
    if is_parallel(cfg):
        return 1
    if cfg.action_start == "prefill":
        return a - 1
    if int(cfg.action_horizon) == 1:
        return int(decode_tokens)
    return max(int(decode_tokens), a + 1)


def chunk_scratch_slots(cfg: ModelConfig, decode_tokens: int) -> int:
    """Scratch slots of a chunk's decode tokens (outside the KV budget, not retained): one per autoregressive step
    (S), or the A parallel slots. gen, the greedy choices, has this + 1 entries (gen[0] from the prefill)."""
    return chunk_action_tokens(cfg) if is_parallel(cfg) else chunk_decode_steps(cfg, decode_tokens)


def describe_decode_steps(cfg: ModelConfig, decode_tokens: int) -> str:
    """S and where it comes from, for messages and logs (H = 1 "token": just ``decode_tokens=N``)."""
    s, a, h = chunk_decode_steps(cfg, decode_tokens), chunk_action_tokens(cfg), int(cfg.action_horizon)
    if is_parallel(cfg):
        return f"1 parallel decode pass over {a} action slots (vla.action_horizon {h} x {cfg.action_dims})"
    if cfg.action_start == "prefill":
        return (f"{s} decode steps (vla.action_start prefill: {h} x {cfg.action_dims} action tokens, the first from "
                "the prefill)")
    if h == 1:
        return f"decode_tokens={int(decode_tokens)}"
    return (f"{s} decode steps (vla.action_horizon {h} x {cfg.action_dims} action tokens + an end token, or "
            f"decode_tokens={int(decode_tokens)} when larger)")


def first_bin_index(cfg: ModelConfig) -> int:
    """Index in gen of the chunk's first action bin: 0 when the prefill gives bin 1, else 1 (after the start)."""
    return 0 if cfg.action_start == "prefill" else 1


def action_token_slice(cfg: ModelConfig) -> slice:
    """The A greedy choices in gen that are the chunk's action bins (plus action_token_offset)."""
    first = first_bin_index(cfg)
    return slice(first, first + chunk_action_tokens(cfg))


def chunk_bins(cfg: ModelConfig, gen: np.ndarray) -> np.ndarray:
    """gen (S + 1,) vocabulary ids -> (H, action_dims) int64 action bins, row k = the chunk's step k."""
    bins = np.asarray(gen, dtype=np.int64)[action_token_slice(cfg)] - cfg.action_token_offset
    if bins.size != chunk_action_tokens(cfg):
        raise EngineError(f"a chunk of {len(gen)} greedy tokens holds {bins.size} action bins, the model needs "
                          f"{chunk_action_tokens(cfg)} (action_horizon {cfg.action_horizon} x {cfg.action_dims})")
    return bins.reshape(int(cfg.action_horizon), int(cfg.action_dims))


def chunk_actions(tokenizer, bins: np.ndarray) -> np.ndarray:
    """(H, action_dims) bins -> (H, action_dims) float32 un-normalised actions, row by row (ActionTokenizer)."""
    return np.stack([tokenizer.bins_to_action(row) for row in bins]).astype(np.float32)


# How a chunk's action slots become actions (the ``action_readout`` parameter; both backends, host-side from the
# logits every backend already copies back). "argmax": each slot's most likely bin's centre, the tokens the decode
# chose (OpenVLA). "expectation": the mean of the bin centres under the slot's softmax over the 256 bins. Why: a
# parallel pass picks every slot's argmax on its own, so neighbouring steps hop between close bins and the
# commanded jerk of a chunk policy was 3-7x the single-step policy's; the expectation is a continuous readout of
# the same distribution (as OpenVLA-OFT's regression head is) and halved that jerk at equal success in the
# synchronous loop (docs/SIM_CHUNKS.md). Its cost: where a slot's distribution has two distant modes the mean lies
# between them. The decoded tokens, ``chunk_bins`` and a forced prefix stay the argmax's: only the actions differ.
ACTION_READOUTS = ("argmax", "expectation")


def check_action_readout(readout: str) -> str:
    if readout not in ACTION_READOUTS:
        raise EngineError(f"action_readout must be one of {', '.join(ACTION_READOUTS)}, got {readout!r}")
    return readout


def readout_actions(cfg: ModelConfig, tokenizer, bins: np.ndarray, logits: np.ndarray, readout: str,
                    forced_steps: int = 0) -> np.ndarray:
    """A chunk's (H, action_dims) float32 actions by ``readout`` (ACTION_READOUTS). ``logits``: the chunk's
    (scratch slots + 1, n_action_bins) logits, row i the distribution gen[i] was chosen from (column b = bin b);
    the first ``forced_steps`` steps are the forced bins' centres (they were given, not decoded)."""
    if check_action_readout(readout) == "argmax":
        return chunk_actions(tokenizer, bins)
    h, dims = int(cfg.action_horizon), int(cfg.action_dims)
    z = np.asarray(logits, np.float64)[action_token_slice(cfg)]
    if z.shape != (h * dims, len(tokenizer.bin_centers)):
        raise EngineError(f"expectation readout: the chunk's action logits have shape {z.shape}, expected "
                          f"({h * dims}, {len(tokenizer.bin_centers)})")
    p = np.exp(z - z.max(axis=1, keepdims=True))
    normalized = ((p / p.sum(axis=1, keepdims=True)) @ tokenizer.bin_centers).reshape(h, dims)
    out = np.stack([tokenizer.unnormalize(row) for row in normalized]).astype(np.float32)
    d = int(forced_steps)
    if d:
        out[:d] = chunk_actions(tokenizer, bins[:d])
    return out


def check_forced_bins(cfg: ModelConfig, forced_bins) -> np.ndarray | None:
    """A forced prefix (``Engine.run_chunk(forced_bins=...)``) as a (d, action_dims) int64 array, None when there
    is none (None or d = 0). ValueError with the reason: not (d, action_dims), not integers, a bin outside
    [0, n_action_bins), or d > action_horizon."""
    if forced_bins is None:
        return None
    arr = np.asarray(forced_bins)
    dims, h, n = int(cfg.action_dims), int(cfg.action_horizon), int(cfg.n_action_bins)
    if arr.ndim != 2 or arr.shape[1] != dims:
        raise ValueError(f"forced_bins must have shape (d, action_dims={dims}), got {arr.shape}")
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"forced_bins must be integer action bins, got dtype {arr.dtype}")
    if arr.shape[0] > h:
        raise ValueError(f"forced_bins has {arr.shape[0]} steps, more than the chunk's action_horizon {h}")
    bad = np.argwhere((arr < 0) | (arr >= n))
    if len(bad):
        k, j = (int(v) for v in bad[0])
        raise ValueError(f"forced_bins must lie in [0, {n}): step {k}, dimension {j} is {int(arr[k, j])}")
    return arr.astype(np.int64) if len(arr) else None


def forced_gen(cfg: ModelConfig, forced: np.ndarray | None, n_gen: int) -> np.ndarray:
    """(n_gen,) int64: the vocabulary id a forced prefix fixes for each entry of gen, -1 where the decode chooses
    (the action-token slice's first d * action_dims entries are the forced bins, time-major)."""
    out = np.full(int(n_gen), -1, np.int64)
    if forced is not None:
        first = first_bin_index(cfg)
        out[first:first + forced.size] = forced.ravel() + cfg.action_token_offset
    return out


def check_positions(cfg: ModelConfig, kv_budget_tokens: int, decode_tokens: int) -> None:
    """Every logical position of a chunk (context slots, then its decode tokens: chunk_scratch_slots) stays
    below max_position_embeddings: the model was not trained past it. ``decode_tokens`` is the parameter."""
    if cfg.max_position_embeddings <= kv_budget_tokens + chunk_scratch_slots(cfg, decode_tokens):
        raise EngineError(f"kv_budget_tokens={kv_budget_tokens} + {describe_decode_steps(cfg, decode_tokens)} "
                          f"must stay below max_position_embeddings={cfg.max_position_embeddings} of {cfg.source}")


def check_prefix(prefix_tokens: int, instruction: str) -> np.ndarray:
    """The KV manager pins exactly the instruction's tokens; returns those token ids."""
    ids = prefix_token_ids(instruction)
    if prefix_tokens != len(ids):
        raise EngineError(f"KV manager pins {prefix_tokens} prefix tokens but the instruction encodes to "
                          f"{len(ids)} bytes")
    return ids


def check_chunk_geometry(cfg: ModelConfig, kv, instruction: str, decode_tokens: int) -> np.ndarray:
    """What a backend checks before it allocates anything, for the KV manager ``kv`` it is handed (its
    tokens_per_frame, prefix_tokens and budget_tokens) and the ``decode_tokens`` parameter (the positions are
    checked for the effective decode steps); returns the instruction's token ids."""
    check_decode_tokens(cfg, decode_tokens)
    check_tokens_per_frame(cfg, kv.tokens_per_frame)
    ids = check_prefix(kv.prefix_tokens, instruction)
    check_positions(cfg, int(kv.budget_tokens), decode_tokens)
    return ids
