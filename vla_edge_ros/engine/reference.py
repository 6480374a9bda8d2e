"""The reference Qwen2 forward: plain numpy, float64 by default (float32 on request), one small step per function.

What it is for:
- the oracle the tests hold both backends to. NumpyEngine (engine/numpy_backend.py) and CudaEngine are
  optimised (slot-addressed caches, a shared rotation offset, speculative decoding, fused kernels); they are
  checked against this file, never the other way round, and nothing here is shared with them but the config,
  the tensor names, the action tokenizer and the chunk's token-layout arithmetic (engine/geometry.py);
- the file a newcomer reads to understand the model and the chunk the runtime runs.

It is slow on purpose: every key is rotated again at every step, the context is concatenated again, every score
is materialised. Modelled on gpt-fast's model.py: the dataclass config is ``engine.config.ModelConfig``; the
weights are a dict by the checkpoint's HF names (``engine.checkpoint.expected_shapes``), so whatever loads into
the engines loads here. Shapes: T new tokens, S cached tokens, H query heads, KV key/value heads, G = H // KV,
D head_dim, hidden = H * D, I intermediate_size, A n_action_bins, tpf tokens per frame.

The chunk (``reference_chunk``; token layout as in engine/interface.py):
- context = the pinned instruction prefix (byte b -> token b) at logical positions 0..P-1, then the retained
  frames oldest -> newest in the KV manager's order, packed: the j-th retained frame holds positions
  P + j*tpf .. P + (j+1)*tpf - 1, so evicting a frame renumbers every newer one.
- a frame's per-layer K/V are computed once, when it arrives, and kept BEFORE RoPE; each chunk rotates them at
  their current logical position. Layer > 0 K/V so keep the context the frame saw on arrival (a KV cache).
- the new frame's tpf tokens sit at n_ctx - tpf .. n_ctx - 1 (n_ctx = P + retained frames * tpf, the new one
  included), see the whole context and themselves causally.
- greedy decode: gen[0] = argmax of the frame's last row; step i = 1..steps feeds gen[i-1] at position
  n_ctx + i - 1. Decode tokens are not retained. A chunk holds N = action_horizon * action_dims action tokens,
  time-major (step 0's bins, then step 1's, ...). The checkpoint's ``vla.action_start`` says what gen[0] is:
  "token" (the seed shape): an action-start token, steps = decode_tokens for a horizon of 1, else
  max(decode_tokens, N + 1) (the bins and an end token), action bins = gen[1..N] - action_token_offset; "prefill"
  (issue 23, OpenVLA's shape): bin 1 itself, steps = N - 1, action bins = gen[0..N-1] - action_token_offset
  (1 prefill + 6 decode passes for 7 bins). That arithmetic is engine/geometry.py's (``chunk_decode_steps``,
  ``chunk_bins``): one rule for every backend, so the oracle takes it from there too; the tests pin its numbers
  independently (test/test_chunk_horizon.py).
- parallel decode (``vla.chunk_decode: parallel``, action_start "token"): after gen[0], ONE forward over the N
  action slots, every input the slot token (geometry.parallel_slot_token: bin 0's id), slot j at position
  n_ctx + j, every slot seeing the whole context and every slot (bidirectional); action bins = gen[1..N].
- forced prefix (``forced_bins``, (d, action_dims) bins): the first d steps' bins are taken instead of the argmax;
  autoregressively they are then fed as inputs like any chosen token (teacher forcing), in parallel they just
  replace the choices. Logits stay the model's. Checked and laid out by geometry.check_forced_bins / forced_gen.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from vla_edge_ros.core.action_tokenizer import from_config as action_tokenizer
from vla_edge_ros.engine.checkpoint import expected_shapes, vision_shapes
from vla_edge_ros.engine.config import ModelConfig
from vla_edge_ros.engine.geometry import (check_forced_bins, chunk_action_tokens, chunk_actions, chunk_bins,
                                          chunk_decode_steps, forced_gen, is_parallel, parallel_slot_token)
from vla_edge_ros.engine.vision import check_image, seeded_vision_weights

LayerKV = tuple[np.ndarray, np.ndarray]  # one layer's keys (pre-RoPE) and values of n tokens: (n, KV, D) each


# ---- weights --------------------------------------------------------------------------------------------------

def load_weights(cfg: ModelConfig, weights: Mapping[str, np.ndarray], dtype=np.float64) -> dict[str, np.ndarray]:
    """The decoder tensors by HF name cast to ``dtype``, plus vision.* (the checkpoint's when it has all three,
    else the seeded init, as engine/vision.py does). A missing or mis-shaped tensor is refused by name."""
    vision = vision_shapes(cfg)
    src = dict(weights) if all(n in weights for n in vision) else {**weights, **seeded_vision_weights(cfg)}
    out = {}
    for name, shape in {**expected_shapes(cfg), **vision}.items():
        if name not in src:
            raise ValueError(f"reference weights: missing tensor {name}")
        out[name] = np.asarray(src[name], dtype=dtype)
        if out[name].shape != shape:
            raise ValueError(f"reference weights: tensor {name}: expected shape {list(shape)}, "
                             f"found {list(out[name].shape)}")
    return out


def embed(w: Mapping[str, np.ndarray], ids: Sequence[int]) -> np.ndarray:
    """Token ids (T,) -> embeddings (T, hidden)."""
    return w["model.embed_tokens.weight"][np.asarray(ids, dtype=np.int64)]


# ---- the building blocks --------------------------------------------------------------------------------------

def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x (T, hidden) -> x / sqrt(mean(x**2) + eps) * weight, row by row: (T, hidden)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope_cos_sin(positions: Sequence[int], head_dim: int, theta: float, dtype=np.float64):
    """cos, sin (n, D) for integer positions (n,): angle[p, j] = p * theta ** (-2 (j mod D/2) / D).

    Angles in float64 from the exact integers, then cast: a table entry never depends on the dtype's rounding
    of a large position.
    """
    inv_freq = 1.0 / float(theta) ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # (D/2,)
    angles = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]  # (n, D/2)
    angles = np.concatenate([angles, angles], axis=-1)  # (n, D): both halves share the frequencies
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


def rotate_half(x: np.ndarray) -> np.ndarray:
    """(..., D) -> concat(-x2, x1) of its halves: HF's convention (not interleaved pairs)."""
    x1, x2 = np.split(x, 2, axis=-1)
    return np.concatenate([-x2, x1], axis=-1)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x (n, heads, D) rotated by the angles of its n positions (cos, sin: (n, D)) -> (n, heads, D)."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """Grouped-query attention: q (T, H, D) and k (S, KV, D) rotated, v (S, KV, D); visible (T, S) bool says
    which keys each query may read (causal or any other mask). -> (T, H * D)."""
    T, H, D = q.shape
    G = H // k.shape[1]
    if not np.all(visible.any(axis=1)):
        raise ValueError("attention: a query sees no key (its softmax would be over nothing)")
    k = np.repeat(k, G, axis=1)  # (S, H, D): query head h reads KV head h // G (HF repeat_kv)
    v = np.repeat(v, G, axis=1)  # (S, H, D)
    scores = np.einsum("thd,shd->hts", q, k) / math.sqrt(D)  # (H, T, S)
    scores = np.where(visible[None], scores, -np.inf)  # (H, T, S): hidden keys get no weight
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))  # (H, T, S); max-subtracted: exp cannot overflow
    probs /= probs.sum(axis=-1, keepdims=True)
    return np.einsum("hts,shd->thd", probs, v).reshape(T, H * D)  # (T, H, D) -> (T, hidden)


def mlp(x: np.ndarray, w: Mapping[str, np.ndarray], p: str) -> np.ndarray:
    """SwiGLU: down(silu(gate(x)) * up(x)), silu(g) = g * sigmoid(g). x (T, hidden) -> (T, hidden)."""
    g = x @ w[p + "mlp.gate_proj.weight"].T  # (T, I)
    u = x @ w[p + "mlp.up_proj.weight"].T  # (T, I)
    return (g / (1.0 + np.exp(-g)) * u) @ w[p + "mlp.down_proj.weight"].T  # (T, hidden)


def decoder_layer(cfg: ModelConfig, w: Mapping[str, np.ndarray], i: int, x: np.ndarray, positions: np.ndarray,
                  past: LayerKV, past_positions: np.ndarray, visible: np.ndarray):
    """Layer i on new tokens x (T, hidden) at ``positions`` (T,), after this layer's cached ``past`` of S tokens
    at ``past_positions`` (S,); visible (T, S + T). -> (x (T, hidden), this layer's pre-RoPE (k, v) of x)."""
    p, eps = f"model.layers.{i}.", cfg.rms_norm_eps
    T, H, KV, D = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def proj(name: str, heads: int) -> np.ndarray:  # q/k/v projection, with Qwen2's bias: (T, heads, D)
        return (h @ w[p + f"self_attn.{name}.weight"].T + w[p + f"self_attn.{name}.bias"]).reshape(T, heads, D)

    h = rms_norm(x, w[p + "input_layernorm.weight"], eps)  # (T, hidden)
    q, k, v = proj("q_proj", H), proj("k_proj", KV), proj("v_proj", KV)  # (T, H, D), (T, KV, D), (T, KV, D)
    keys = np.concatenate([past[0], k])  # (S + T, KV, D), before RoPE
    values = np.concatenate([past[1], v])  # (S + T, KV, D)
    key_positions = np.concatenate([past_positions, positions])  # (S + T,)
    q = apply_rope(q, *rope_cos_sin(positions, D, cfg.rope_theta, x.dtype))  # (T, H, D)
    keys = apply_rope(keys, *rope_cos_sin(key_positions, D, cfg.rope_theta, x.dtype))  # (S + T, KV, D)
    x = x + attention(q, keys, values, visible) @ w[p + "self_attn.o_proj.weight"].T  # (T, hidden); no o bias
    x = x + mlp(rms_norm(x, w[p + "post_attention_layernorm.weight"], eps), w, p)  # (T, hidden)
    return x, (k, v)


def empty_kv(cfg: ModelConfig, dtype) -> LayerKV:
    """No cached tokens: (0, KV, D) keys and values."""
    z = np.zeros((0, cfg.num_key_value_heads, cfg.head_dim), dtype=dtype)
    return z, z


def forward(cfg: ModelConfig, w: Mapping[str, np.ndarray], x: np.ndarray, positions=None,
            past: list[LayerKV] | None = None, past_positions=None, visible=None):
    """The decoder over new tokens x (T, hidden) (embeddings or vision tokens), computed in the weights' dtype.

    positions (T,): default S .. S + T - 1 after the S cached tokens of ``past`` (per layer (K, V), pre-RoPE) at
    ``past_positions`` (default 0 .. S - 1); visible (T, S + T) bool: default every cached token plus causal
    among x. Returns (hidden (T, hidden) before the final norm, per layer the pre-RoPE (k, v) of x).
    """
    dtype = w["model.norm.weight"].dtype
    x = np.asarray(x, dtype=dtype)
    L, T = cfg.num_hidden_layers, x.shape[0]
    past = past if past is not None else [empty_kv(cfg, dtype)] * L
    S = past[0][0].shape[0]
    positions = np.arange(S, S + T) if positions is None else np.asarray(positions)
    past_positions = np.arange(S) if past_positions is None else np.asarray(past_positions)
    if visible is None:
        visible = np.concatenate([np.ones((T, S), bool), np.tril(np.ones((T, T), bool))], axis=1)  # (T, S + T)
    new_kv = []
    for i in range(L):
        x, kv = decoder_layer(cfg, w, i, x, positions, past[i], past_positions, visible)
        new_kv.append(kv)
    return x, new_kv


def action_logits(cfg: ModelConfig, w: Mapping[str, np.ndarray], h: np.ndarray) -> np.ndarray:
    """Final RMSNorm, then the LM head's last A vocabulary rows (the action bins): h (T, hidden) -> (T, A).
    The head is the embedding when tied, else lm_head.weight."""
    head = w["model.embed_tokens.weight"] if cfg.tie_word_embeddings else w["lm_head.weight"]  # (vocab, hidden)
    return rms_norm(h, w["model.norm.weight"], cfg.rms_norm_eps) @ head[cfg.action_token_offset:].T  # (T, A)


# ---- the vision front end (engine/vision.py, plainly) --------------------------------------------------------

def resize(image: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """(h, w, 3) uint8 -> (out_h, out_w, 3) float64 in [0, 255]: each output pixel averages the 2 x 2 source
    pixels under the points at 1/4 and 3/4 of its footprint in each direction."""
    def index(n_src: int, n_dst: int, frac: float) -> np.ndarray:  # (n_dst,) source index under each point
        i = np.floor((np.arange(n_dst, dtype=np.float64) + frac) * (n_src / n_dst)).astype(np.int64)
        return np.clip(i, 0, n_src - 1)

    h, w = image.shape[:2]
    ys = (index(h, out_h, 0.25), index(h, out_h, 0.75))
    xs = (index(w, out_w, 0.25), index(w, out_w, 0.75))
    return sum(image[y][:, x].astype(np.float64) for y in ys for x in xs) / 4.0  # (out_h, out_w, 3)


def patch_embed(cfg: ModelConfig, w: Mapping[str, np.ndarray], image: np.ndarray) -> np.ndarray:
    """Camera image (H, W, 3) uint8 (or greyscale) -> (n_patches, hidden) vision tokens in the weights' dtype."""
    (gh, gw), p = cfg.patch_grid, cfg.patch_size
    x = resize(check_image(image), gh * p, gw * p)  # (gh*p, gw*p, 3)
    x = x.reshape(gh, p, gw, p, 3).transpose(0, 2, 1, 3, 4).reshape(gh * gw, p * p * 3)  # (n_patches, patch_dim):
    x = (x / 255.0 - 0.5).astype(w["vision.pos_embed"].dtype)  # patches row-major, each (row, col, channel)
    return x @ w["vision.patch_embed.weight"].T + w["vision.patch_embed.bias"] + w["vision.pos_embed"]


# ---- the chunk as the runtime builds it -----------------------------------------------------------------------

@dataclass
class ReferenceChunk:
    frame_id: int
    logits: np.ndarray  # (steps + 1, A): row 0 from the frame's last token, row i from decode step i
    token_ids: np.ndarray  # (steps + 1,) greedy choices gen[0..steps], vocabulary ids (module docstring)
    action_bins: np.ndarray  # (action_dims,) in [0, A): the chunk's first step (chunk_bins[0])
    action: np.ndarray  # (action_dims,) float32, un-normalised with q01 / q99: chunk[0]
    evicted: list[int]  # frames the KV manager evicted to admit this one
    chunk_bins: np.ndarray  # (H, action_dims) bins, row k = the chunk's step k
    chunk: np.ndarray  # (H, action_dims) float32 un-normalised actions
    forced_steps: int = 0  # d: chunk_bins[:d] were forced (forced_bins), not decoded


@dataclass
class ReferenceStream:
    """State between chunks: weights, the KV manager that decides what is retained, cached K/V by frame id."""
    cfg: ModelConfig
    w: dict[str, np.ndarray]
    kv: object  # core.kv.manager.KVManager (only its order of frames is used, not its slots)
    decode_tokens: int
    prefix: list[LayerKV]
    frames: dict[int, list[LayerKV]] = field(default_factory=dict)


def start_stream(cfg: ModelConfig, weights: Mapping[str, np.ndarray], kv, instruction: str = "",
                 decode_tokens: int = 8, dtype=np.float64) -> ReferenceStream:
    """Prefill the pinned prefix (instruction bytes at positions 0..P-1, causal) for a stream of chunks."""
    ids = np.frombuffer(instruction.encode("utf-8"), dtype=np.uint8).astype(np.int64)  # byte b -> token id b
    for wrong, why in ((kv.prefix_tokens != len(ids), f"the KV manager pins {kv.prefix_tokens} prefix tokens, "
                                                        f"the instruction encodes to {len(ids)} bytes"),
                       (kv.tokens_per_frame != cfg.n_patches, f"tokens_per_frame={kv.tokens_per_frame}, the "
                                                              f"patch embedder makes {cfg.n_patches} per frame"),
                       (decode_tokens < cfg.action_dims, f"decode_tokens={decode_tokens} < {cfg.action_dims} "
                                                         "action dimensions")):
        if wrong:
            raise ValueError(f"reference stream: {why}")
    w = load_weights(cfg, weights, dtype)
    prefix = forward(cfg, w, embed(w, ids))[1] if len(ids) else [empty_kv(cfg, dtype)] * cfg.num_hidden_layers
    return ReferenceStream(cfg, w, kv, int(decode_tokens), prefix)


def _concat(segments: list[list[LayerKV]]) -> list[LayerKV]:
    """Token segments (each per layer (k, v)) -> per layer (K, V) of all their tokens in order."""
    return [(np.concatenate([s[i][0] for s in segments]), np.concatenate([s[i][1] for s in segments]))
            for i in range(len(segments[0]))]


def reference_chunk(stream: ReferenceStream, tokens: np.ndarray, frame_id: int, salient: bool = False,
                    forced_bins=None):
    """One chunk (module docstring): admit the frame into the KV manager (which evicts by its policy), prefill
    its tokens (tpf, hidden) after prefix + retained frames, decode greedily (or in parallel), the first d steps
    forced to ``forced_bins`` when given. -> ReferenceChunk."""
    cfg, w, kv = stream.cfg, stream.w, stream.kv
    tokens = np.asarray(tokens, dtype=np.float32)  # what the engines receive (interface.check_vision_tokens)
    if tokens.shape != (kv.tokens_per_frame, cfg.hidden_size) or not np.all(np.isfinite(tokens)):
        raise ValueError(f"reference chunk: vision tokens must be finite, shape ({kv.tokens_per_frame}, "
                         f"{cfg.hidden_size}); got shape {tokens.shape}")
    forced_rows = check_forced_bins(cfg, forced_bins)  # (d, action_dims) or None; ValueError with the reason
    admission = kv.admit(frame_id, tokens.mean(axis=0), salient)  # pooled embedding, as the engines pass it
    kv.take_moves()  # K/V are held by frame id here: slot relocations after a budget shrink change nothing
    retained = kv.frames[:-1]  # oldest -> newest, without the new frame (admitted last)
    stream.frames = {f: stream.frames[f] for f in retained}  # evicted frames' K/V are gone
    context = [stream.prefix] + [stream.frames[f] for f in retained]
    S = sum(len(seg[0][0]) for seg in context)  # cached tokens at logical positions 0..S-1
    n_ctx = S + len(tokens)
    h, frame_kv = forward(cfg, w, tokens, np.arange(S, n_ctx), _concat(context))  # (tpf, hidden)
    stream.frames[frame_id] = frame_kv
    off = cfg.action_token_offset
    n = chunk_action_tokens(cfg)
    steps = chunk_decode_steps(cfg, stream.decode_tokens)  # module docstring (1 for parallel: one pass)
    forced = forced_gen(cfg, forced_rows, 1 + (n if is_parallel(cfg) else steps))  # -1: the decode chooses

    def choose(row_logits: np.ndarray) -> int:  # the forced token of the next entry of gen, else the argmax
        f = int(forced[len(gen)])
        return f if f >= 0 else int(np.argmax(row_logits)) + off

    gen: list[int] = []
    logits = [action_logits(cfg, w, h[-1:])[0]]  # (A,) from the frame's last token
    gen.append(choose(logits[0]))
    if is_parallel(cfg):
        slots = embed(w, [parallel_slot_token(cfg)] * n)  # (N, hidden): every slot's input is the slot token
        visible = np.ones((n, n_ctx + n), bool)  # the whole context and every slot: bidirectional
        h, _ = forward(cfg, w, slots, np.arange(n_ctx, n_ctx + n), _concat(context + [frame_kv]), visible=visible)
        for row in action_logits(cfg, w, h):  # (N, A)
            logits.append(row)
            gen.append(choose(row))
    decoded: list[list[LayerKV]] = []  # this chunk's decode tokens, not retained
    for i in range(1, 0 if is_parallel(cfg) else steps + 1):
        h, kv_i = forward(cfg, w, embed(w, [gen[-1]]), [n_ctx + i - 1], _concat(context + [frame_kv] + decoded))
        decoded.append(kv_i)
        logits.append(action_logits(cfg, w, h)[0])
        gen.append(choose(logits[-1]))
    bins = chunk_bins(cfg, np.asarray(gen, dtype=np.int64))  # (H, action_dims)
    actions = chunk_actions(action_tokenizer(cfg), bins)  # (H, action_dims)
    return ReferenceChunk(int(frame_id), np.stack(logits), np.asarray(gen, dtype=np.int64), bins[0], actions[0],
                          list(admission.evicted), bins, actions, 0 if forced_rows is None else len(forced_rows))
