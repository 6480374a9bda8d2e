"""The numpy engine's decode after the prefill (engine/numpy_backend.py): greedy autoregressive decoding with exact
speculative drafts, and the parallel pass. Kept apart from the engine so that its cache bookkeeping and its
forward stay one file each; these functions drive ``NumpyEngine`` through its ``_forward_tokens``, ``_lm_head``
and ``_context_segment`` and change nothing but ``gen``, ``logits``, the scratch slots and ``last_decode_passes``.

Both take ``forced``, geometry.forced_gen's (len(gen),) array: the vocabulary id a forced prefix fixes for an
entry of gen, -1 where the decode chooses (engine/interface.py's module docstring, "Forced prefix").

Autoregressive (``decode_autoregressive``). Exact speculative decoding: one pass feeds gen[i-1] followed by a
draft of the remaining steps; row j's logits are valid as long as every earlier draft token equalled the token
actually chosen, so each pass yields at least one token and the result equals plain greedy decoding. A pass reads
the whole KV context once whatever its width, so accepted drafts save whole passes. The draft of an entry is its
forced token when it has one, else the previous draft token (gen[i-1] repeated, when nothing is forced). Forced
tokens are known in advance, so they are drafted and always accepted: a forced prefix of d steps costs no extra
passes (with the prefix and the first free token in one pass, d * action_dims tokens come for free — a speed-up,
besides the consistency with what the robot has already committed). ``speculative = False``: one token per pass.

Parallel (``decode_parallel``, vla.chunk_decode "parallel"). ONE pass over the A action slots (A scratch slots):
every input is geometry.parallel_slot_token, slot j at position n_ctx + j, attention over the whole context plus
all A slots with NO mask among them (bidirectional; the speculative pass above is the same k-wide pass with a
causal scratch mask). ``parallel_pass`` builds that pass's inputs; the fleet (engine/fleet_numpy.py) uses it too.
A forced prefix replaces the first d steps' choices (no slot reads another's choice: nothing to condition).
"""
from __future__ import annotations

import numpy as np

from vla_edge_ros.engine.geometry import chunk_action_tokens, parallel_slot_token

NEG_INF = np.float32(-np.inf)


def decode_autoregressive(eng, gen: np.ndarray, logits: np.ndarray, n_ctx: int, r_end: int,
                          forced: np.ndarray) -> None:
    """Greedy decode of gen[1..decode_steps] (gen[0] and logits[0] are set; module docstring)."""
    dec = eng.decode_steps
    off = eng.cfg.action_token_offset
    ctx_seg = eng._context_segment(np.zeros(0, np.int64), r_end)
    s0 = eng.capacity
    i = 1
    eng.last_decode_passes = 0
    while i <= dec:
        k = dec - i + 1 if eng.speculative else 1
        tokens = np.empty(k, np.int64)  # tokens[j] stands for gen[i - 1 + j]
        tokens[0] = gen[i - 1]
        for j in range(1, k):
            f = forced[i - 1 + j]
            tokens[j] = f if f >= 0 else tokens[j - 1]
        start = s0 + i - 1  # scratch slot of the first row
        slots = np.arange(start, start + k)
        positions = np.arange(n_ctx + i - 1, n_ctx + i - 1 + k)
        causal = np.where(np.tri(k, start + k - s0, start - s0, dtype=bool), np.float32(0.0), NEG_INF)
        scratch_seg = (s0, start + k, None, causal)
        h = eng._forward_tokens(eng.embed[tokens], slots, positions, [ctx_seg, scratch_seg], last_only=False)
        lg = eng._lm_head(h)
        choice = np.argmax(lg, axis=1) + off
        eng.last_decode_passes += 1
        for j in range(k):
            logits[i + j] = lg[j]
            gen[i + j] = forced[i + j] if forced[i + j] >= 0 else choice[j]
            if j + 1 < k and tokens[j + 1] != gen[i + j]:
                k = j + 1
                break
        i += k


def parallel_pass(eng, n_ctx: int, r_end: int):
    """The parallel pass of ``eng``'s chunk: (input token ids (A,), scratch slots (A,), positions (A,), attention
    segments: the visible context, then every scratch slot with no bias, i.e. bidirectional among the slots)."""
    a = chunk_action_tokens(eng.cfg)
    s0 = eng.capacity
    tokens = np.full(a, parallel_slot_token(eng.cfg), np.int64)
    segments = [eng._context_segment(np.zeros(0, np.int64), r_end), (s0, s0 + a, None, None)]
    return tokens, np.arange(s0, s0 + a), np.arange(n_ctx, n_ctx + a), segments


def decode_parallel(eng, gen: np.ndarray, logits: np.ndarray, n_ctx: int, r_end: int, forced: np.ndarray) -> None:
    """gen[1..A] from one pass over the A action slots (gen[0] and logits[0] are set; module docstring)."""
    tokens, slots, positions, segments = parallel_pass(eng, n_ctx, r_end)
    lg = eng._lm_head(eng._forward_tokens(eng.embed[tokens], slots, positions, segments, last_only=False))
    a = len(tokens)
    logits[1:1 + a] = lg
    gen[1:1 + a] = np.argmax(lg, axis=1) + eng.cfg.action_token_offset
    np.copyto(gen, forced, where=forced >= 0)
    eng.last_decode_passes = 1
