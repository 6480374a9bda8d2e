"""CPU reference backend: a Qwen2 decoder in float32 numpy with a slot-addressed, budget-bounded KV cache.

Model: token embedding, per layer RMSNorm -> q/k/v projections (with biases) -> RoPE -> grouped-query
attention -> o_proj -> residual -> RMSNorm -> SwiGLU MLP -> residual; final RMSNorm; LM head restricted to the
last ``n_action_bins`` vocabulary rows (tied to the embedding unless the checkpoint has ``lm_head.weight``).

KV cache: ``k_pre`` (keys BEFORE RoPE) of shape ``[layers, capacity + scratch_slots, kv_heads, head_dim]``;
``v`` and the rotated-key cache ``k_rot`` are stored head-major, ``[layers, kv_heads, capacity + scratch_slots,
head_dim]``, so each (layer, head) is one contiguous matrix for BLAS (decode is memory-bound: a strided layout
cost 2-3x). Slot ``s`` is addressed as the KVManager hands it out; the ``scratch_slots`` after the capacity
(geometry.chunk_scratch_slots: S decode steps, or A parallel slots) hold the decode tokens of the current chunk
only. Attention runs over the physical slot range
``[0, max context slot]`` with an additive mask (free slots, evicted frames: -inf; the new frame: causal), so
eviction never moves or gathers K/V.

Positions: a context slot's logical position is its index in ``KVManager.context_slots()``; the new frame's
queries sit at n_ctx-32 .. n_ctx-1, decode step i at n_ctx + i - 1; all below ``capacity + scratch_slots``
for ever. A second array ``k_rot`` caches the rotated keys. Because RoPE scores depend only on the position
difference, rotating every key AND every query by the same extra offset ``delta`` leaves attention unchanged;
the engine keeps one ``delta`` such that ``k_rot[s] = rope(k_pre[s], logical(s) + delta)`` for every context
slot. When FIFO / sliding-window eviction shifts every frame down by one frame, increasing ``delta`` by
``tokens_per_frame`` restores that invariant without touching a single key (only the pinned prefix, whose
positions do not move, is re-rotated: a few slots). Semantic eviction in the middle shifts only the newer
frames: ``delta`` follows the majority and the minority is re-rotated from ``k_pre`` (exact, no drift).
``delta`` is reset to 0 (full re-rotation) before any rotation position would reach
``max_position_embeddings``, so every rotation angle used lies inside the model's trained range too.

Chunk shape (``vla.action_start``, issue 23; ``vla.action_horizon`` H, issue 22): the layout of
engine/interface.py, arithmetic from engine/geometry.py. ``decode_steps`` = S: "token" (default, the seed shape):
gen[0] is an action-start token, S = decode_tokens (H = 1) or max(decode_tokens, H * action_dims + 1), the bins
are gen[1..A]; "prefill": gen[0] IS bin 1, S = A - 1, the bins are gen[0..A-1] (A = H * action_dims, time-major).
``vla.chunk_decode: parallel``: one pass over the A action slots, ``decode_steps`` = 1, ``scratch_slots`` = A.
The decode itself (autoregressive with exact speculative drafts, the parallel pass, a forced prefix in either) is
engine/numpy_decode.py's.

Weights (``weight_dtype``, issue 23): bf16 computes with the weights as handed over (unchanged). int8 / fp8 /
int4 quantise them with engine/quant.quantize_weights (or take a pre-quantised ``QuantizedModel``) and compute with
float32 copies dequantised ONCE at load: the dequantised values are the ones the kernels must produce, and a
float32 matmul with them is the oracle arithmetic (engine/quant.py). So this backend holds float32 copies, not
codes: ``memory()["current_bytes"]`` is what it holds, ``memory()["device_weight_bytes"]`` the weights' size in
``weight_dtype`` as a GPU would hold them (quant.weights_nbytes, the VRAM check's count).
"""
from __future__ import annotations

import time
from typing import Any, Mapping, NamedTuple

import numpy as np

from vla_edge_ros.core.action_tokenizer import ActionTokenizer
from vla_edge_ros.engine.checkpoint import check_weights, expected_shapes
from vla_edge_ros.engine.config import ModelConfig
from vla_edge_ros.engine.geometry import (check_action_readout, check_chunk_geometry, check_forced_bins, chunk_bins,
                                          chunk_decode_steps, chunk_scratch_slots, forced_gen, is_parallel,
                                          readout_actions)
from vla_edge_ros.engine.geometry import prefix_token_ids  # noqa: F401  (re-exported)
from vla_edge_ros.engine.interface import ChunkResult, Engine, EngineError, check_vision_tokens
from vla_edge_ros.engine.numpy_decode import decode_autoregressive, decode_parallel
from vla_edge_ros.engine.quant import WEIGHT_DTYPES, QuantizedModel, quantize_weights, weights_nbytes
from vla_edge_ros.engine.rope import RopeTable
from vla_edge_ros.engine.vision import PatchEmbedder, pooled

NEG_INF = np.float32(-np.inf)
_SAFE_EXP = 60.0  # |score| below this: exp(score) stays a normal float32 (no max-subtraction needed)


def _rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    var = np.einsum("ij,ij->i", x, x)[:, None] * np.float32(1.0 / x.shape[1])
    return x * (1.0 / np.sqrt(var + np.float32(eps))) * w


def dequantized_weights(cfg: ModelConfig, weights, weight_dtype: str) -> Mapping[str, np.ndarray]:
    """The float weights the engine computes with for ``weight_dtype`` (module docstring): ``weights`` unchanged for
    bf16, else quantised and dequantised (or a QuantizedModel's own dequantisation, which must be in
    ``weight_dtype``). EngineError naming the cause for a bad value or a mismatch."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise EngineError(f"weight_dtype={weight_dtype!r} is not one of {', '.join(WEIGHT_DTYPES)}")
    if isinstance(weights, QuantizedModel):
        if weights.weight_dtype != weight_dtype:
            raise EngineError(f"the weights are quantised as {weights.weight_dtype}, weight_dtype={weight_dtype!r} "
                              f"was asked: configure weight_dtype {weights.weight_dtype}, or quantise the bf16 "
                              "checkpoint at load")
        return weights.dequantized()
    if weight_dtype == "bf16":
        return weights
    check_weights(cfg, weights)  # names and shapes first: a missing tensor is named as such, not as a quant error
    try:
        return quantize_weights(weights, weight_dtype).dequantized()
    except ValueError as exc:
        raise EngineError(f"weight_dtype={weight_dtype}: cannot quantise the weights: {exc}") from exc


def _silu_mul(gu: np.ndarray, inter: int) -> np.ndarray:
    g = gu[:, :inter]
    u = gu[:, inter:]
    return g / (1.0 + np.exp(-g)) * u


class _Layer:
    __slots__ = ("wqkv_t", "bqkv", "wo_t", "wgu_t", "wd_t", "ln1", "ln2")

    def __init__(self, w: Mapping[str, np.ndarray], i: int):
        p = f"model.layers.{i}."
        f32 = lambda a: np.asarray(a, dtype=np.float32)  # noqa: E731
        self.wqkv_t = np.ascontiguousarray(np.concatenate(
            [f32(w[p + "self_attn.q_proj.weight"]), f32(w[p + "self_attn.k_proj.weight"]),
             f32(w[p + "self_attn.v_proj.weight"])], axis=0).T)
        self.bqkv = np.concatenate([f32(w[p + "self_attn.q_proj.bias"]), f32(w[p + "self_attn.k_proj.bias"]),
                                    f32(w[p + "self_attn.v_proj.bias"])])
        self.wo_t = np.ascontiguousarray(f32(w[p + "self_attn.o_proj.weight"]).T)
        self.wgu_t = np.ascontiguousarray(np.concatenate(
            [f32(w[p + "mlp.gate_proj.weight"]), f32(w[p + "mlp.up_proj.weight"])], axis=0).T)
        self.wd_t = np.ascontiguousarray(f32(w[p + "mlp.down_proj.weight"]).T)
        self.ln1 = f32(w[p + "input_layernorm.weight"]).copy()
        self.ln2 = f32(w[p + "post_attention_layernorm.weight"]).copy()

    def nbytes(self) -> int:
        return sum(getattr(self, n).nbytes for n in self.__slots__)


class CachePart(NamedTuple):
    """One KV cache's share of a forward pass: its engine, its rows [r0, r1) of the stacked activations, their
    placement (NumpyEngine._placement) and the attention segments of those rows."""
    eng: "NumpyEngine"
    rows: tuple[int, int]
    place: Any
    segments: list


def forward_parts(layers, cfg: ModelConfig, x: np.ndarray, parts, last_only: bool) -> np.ndarray:
    """The decoder over stacked rows ``x`` (modified in place) from one or more KV caches: the dense parts
    (norms, q/k/v, o_proj, MLP) once on all rows, the cache parts (K/V writes, RoPE, attention) per part on its
    rows. One engine's pass is one part; a fleet's batch (engine/fleet_numpy.py) is a part per robot.
    ``last_only``: the last layer keeps each part's last row only (the others feed nothing; their K/V of that
    layer come from its input). Returns the final hidden rows."""
    eps, inter = cfg.rms_norm_eps, cfg.intermediate_size
    n_layers = len(layers)
    for li, L in enumerate(layers):
        last = last_only and li == n_layers - 1
        xn = _rmsnorm(x, L.ln1, eps)
        qkv = xn @ L.wqkv_t
        qkv += L.bqkv
        outs = []
        for p in parts:
            r0, r1 = p.rows
            trim = last and r1 - r0 > 1
            q = p.eng._store_kv(li, qkv[r0:r1], p.place, trim)
            segs = [(a, b, c, None if v is None else v[-1:]) for a, b, c, v in p.segments] if trim \
                else p.segments
            outs.append(p.eng._attend(li, q, segs))
        if last:
            x = x[[p.rows[1] - 1 for p in parts]]
        x += (outs[0] if len(outs) == 1 else np.concatenate(outs)) @ L.wo_t
        xn = _rmsnorm(x, L.ln2, eps)
        x += _silu_mul(xn @ L.wgu_t, inter) @ L.wd_t
    for p in parts:
        p.eng.rot_pos[p.place[0]] = p.place[3]
    return x


class NumpyWeights:
    """The float32 arrays an engine computes with (and its RoPE table), built once from a checkpoint's tensors.
    Engines handed the same instance share them without a copy: a fleet (engine/fleet_numpy.py) holds the
    weights once and a KV cache per robot."""

    def __init__(self, cfg: ModelConfig, weights, weight_dtype: str = "bf16"):
        self.cfg, self.weight_dtype = cfg, weight_dtype
        weights = dequantized_weights(cfg, weights, weight_dtype)
        check_weights(cfg, weights)
        self.device_weight_bytes = weights_nbytes(expected_shapes(cfg, include_vision=True), weight_dtype)
        self.layers = [_Layer(weights, i) for i in range(cfg.num_hidden_layers)]
        self.embed = np.ascontiguousarray(np.asarray(weights["model.embed_tokens.weight"], dtype=np.float32))
        head = weights["lm_head.weight"] if not cfg.tie_word_embeddings else self.embed
        self.head_t = np.ascontiguousarray(np.asarray(head, dtype=np.float32)[cfg.action_token_offset:].T)
        self.final_norm = np.asarray(weights["model.norm.weight"], dtype=np.float32).copy()
        self.vision = PatchEmbedder(cfg, weights)
        # rotation positions must stay below max_position_embeddings; the table covers exactly that range
        self.rope = RopeTable(cfg.max_position_embeddings, cfg.head_dim, cfg.rope_theta)

    def nbytes(self) -> int:
        arrays = [self.embed, self.head_t, self.final_norm, self.rope.cos, self.rope.sin_signed,
                  self.vision.weight_t, self.vision.bias_pos, *self.layers]
        return sum(a.nbytes() if isinstance(a, _Layer) else a.nbytes for a in arrays)


class NumpyEngine(Engine):
    name = "numpy"

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, np.ndarray] | NumpyWeights, kv,
                 instruction: str = "", decode_tokens: int = 8, weight_dtype: str = "bf16",
                 action_readout: str = "argmax"):
        self.cfg = cfg
        self.kv = kv
        self.action_readout = check_action_readout(action_readout)  # how slots become actions (geometry.py)
        self.decode_tokens = int(decode_tokens)
        self.prefix_ids = check_chunk_geometry(cfg, kv, instruction, self.decode_tokens)
        self.decode_steps = chunk_decode_steps(cfg, self.decode_tokens)  # S (module docstring): the cost model's
        self.scratch_slots = chunk_scratch_slots(cfg, self.decode_tokens)  # S, or A parallel slots: sizes scratch
        self.weight_dtype = weight_dtype
        if not isinstance(weights, NumpyWeights):  # a checkpoint's tensors; a NumpyWeights is shared as it is
            weights = NumpyWeights(cfg, weights, weight_dtype)
        elif weights.cfg != cfg or weights.weight_dtype != weight_dtype:
            raise EngineError(f"shared NumpyWeights ({weights.weight_dtype}) were built for another config or "
                              f"weight_dtype than this engine's ({weight_dtype})")
        self.weights, self.device_weight_bytes = weights, weights.device_weight_bytes

        self.H, self.KV, self.D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.G = self.H // self.KV
        self.hidden = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.scale = np.float32(1.0 / np.sqrt(self.D))
        self.layers, self.embed, self.head_t = weights.layers, weights.embed, weights.head_t
        self.final_norm, self.vision, self.rope = weights.final_norm, weights.vision, weights.rope
        self.tokenizer = ActionTokenizer(cfg.vocab_size, cfg.action_q01, cfg.action_q99, cfg.n_action_bins)

        self.delta = 0  # extra rotation offset shared by every cached key (see module docstring)
        self.rerotated_slots = 0  # keys re-rotated in the last chunk (diagnostics)
        self.last_logits: np.ndarray | None = None  # (scratch_slots + 1, n_action_bins) of the last chunk
        self.last_max_position = -1  # largest logical position used by the last chunk
        self.last_max_rotation_position = -1
        self.last_decode_passes = 0
        self.speculative = True  # exact speculative decoding (engine/numpy_decode.py); False = one token per pass
        self._peak_bytes = 0
        self._closed = False
        self._allocate(kv.budget_tokens)
        self._prefill_prefix()

    # ---- memory ---------------------------------------------------------------------------------------------
    def _allocate(self, capacity: int) -> None:
        L = self.cfg.num_hidden_layers
        old = getattr(self, "k_pre", None)
        old_cap = getattr(self, "capacity", 0)
        self.capacity = int(capacity)
        S = self.capacity + self.scratch_slots
        k_pre = np.zeros((L, S, self.KV, self.D), np.float32)
        v = np.zeros((L, self.KV, S, self.D), np.float32)
        k_rot = np.zeros_like(v)
        rot_pos = np.full(S, -1, np.int64)
        k_norm = np.zeros((L, self.KV, S), np.float32)  # |k| per slot (rotation keeps it) for the score bound
        if old is not None:
            n = min(old_cap, self.capacity)
            k_pre[:, :n] = old[:, :n]
            v[:, :, :n] = self.v[:, :, :n]
            k_rot[:, :, :n] = self.k_rot[:, :, :n]
            rot_pos[:n] = self.rot_pos[:n]
            k_norm[:, :, :n] = self.k_norm[:, :, :n]
        self.k_pre, self.v, self.k_rot, self.rot_pos, self.k_norm = k_pre, v, k_rot, rot_pos, k_norm
        tpf = self.kv.tokens_per_frame
        self._bias_base = np.full(self.capacity, NEG_INF, np.float32)
        self._scores = np.empty(self.G * tpf * self.capacity, np.float32)
        self._ones = np.ones(S, np.float32)
        self._track_peak()

    def _track_peak(self) -> None:
        self._peak_bytes = max(self._peak_bytes, self.memory()["current_bytes"])

    def cache_bytes(self) -> int:
        """Bytes of this engine's own KV cache and scratch (what a fleet adds per robot; not the weights)."""
        arrays = [self.k_pre, self.v, self.k_rot, self.rot_pos, self.k_norm, self._bias_base, self._scores, self._ones]
        return sum(a.nbytes for a in arrays)

    def memory(self) -> dict[str, int]:
        cur = self.cache_bytes() + self.weights.nbytes()
        return {"current_bytes": int(cur), "peak_bytes": int(max(self._peak_bytes, cur)),
                "device_weight_bytes": int(self.device_weight_bytes)}

    @property
    def tokens_per_frame(self) -> int:
        return self.kv.tokens_per_frame

    # ---- the pinned prefix ----------------------------------------------------------------------------------
    def _prefill_prefix(self) -> None:
        P = len(self.prefix_ids)
        if P == 0:
            return
        slots = np.asarray(self.kv.prefix_slots, dtype=np.int64)
        x = self.embed[self.prefix_ids]
        self._bias_base[:] = NEG_INF
        seg = self._context_segment(slots, int(slots.max()) + 1)
        self._forward_tokens(x, slots, np.arange(P), [seg], last_only=True)

    # ---- engine API -----------------------------------------------------------------------------------------
    def encode_frame(self, image: np.ndarray) -> np.ndarray:
        return self.vision(image)

    def reset(self) -> None:
        """Drop every retained frame; the pinned prefix (its K/V and slots) stays."""
        if hasattr(self.kv, "reset"):
            self.kv.reset()
        else:  # KVManager without reset(): an identical fresh manager (the runtime must use engine.kv)
            kv = self.kv
            self.kv = type(kv)(kv.budget_tokens, kv.tokens_per_frame, kv.prefix_tokens, policy=kv.policy,
                               window_frames=kv.window_frames, semantic_evict=kv.semantic_evict)

    def close(self) -> None:
        """Free the KV cache and scratch buffers; the engine refuses further chunks."""
        self._closed = True
        empty = np.zeros((len(self.layers), self.KV, 0, self.D), np.float32)
        self.k_pre, self.v, self.k_rot = np.zeros((len(self.layers), 0, self.KV, self.D), np.float32), empty, empty
        self.k_norm = np.zeros((len(self.layers), self.KV, 0), np.float32)
        self.rot_pos = np.zeros(0, np.int64)
        self._scores = self._ones = self._bias_base = np.zeros(0, np.float32)

    def run_chunk(self, vision_tokens: np.ndarray, frame_id: int, salient: bool = False,
                  forced_bins: np.ndarray | None = None) -> ChunkResult:
        t0 = time.perf_counter()
        if self._closed:
            raise EngineError("the numpy engine was closed")
        tpf = self.kv.tokens_per_frame
        x = check_vision_tokens(vision_tokens, tpf, self.hidden)
        forced_rows = check_forced_bins(self.cfg, forced_bins)  # ValueError before the cache is touched
        forced = forced_gen(self.cfg, forced_rows, self.scratch_slots + 1)
        adm, n_ctx, new_slots, r_end = self._admit_frame(x, frame_id, salient)
        t1 = time.perf_counter()
        seg = self._context_segment(new_slots, r_end)
        h_last = self._forward_tokens(x, new_slots, np.arange(n_ctx - tpf, n_ctx), [seg], last_only=True)
        logits = np.empty((self.scratch_slots + 1, self.cfg.n_action_bins), np.float32)
        gen = np.empty(self.scratch_slots + 1, np.int64)
        logits[0] = self._lm_head(h_last)[0]
        gen[0] = forced[0] if forced[0] >= 0 else int(np.argmax(logits[0])) + self.cfg.action_token_offset
        t2 = time.perf_counter()
        self._bias_base[new_slots] = 0.0  # decode tokens see the whole new frame
        self._decode(gen, logits, n_ctx, r_end, forced)
        t3 = time.perf_counter()
        return self._chunk_result(frame_id, salient, gen, logits, adm, n_ctx, (t2 - t1) * 1e3, (t3 - t2) * 1e3, t0,
                                  forced_steps=0 if forced_rows is None else len(forced_rows))

    def _admit_frame(self, x: np.ndarray, frame_id: int, salient: bool):
        """A chunk's cache bookkeeping before its forward: the KV manager admits the frame (evicting by policy),
        ``delta`` is aligned, ``_bias_base`` shows the retained context. -> (admission, n_ctx, new_slots, r_end)."""
        self._apply_moves()
        adm = self.kv.admit(frame_id, pooled(x), salient)
        if self.kv.budget_tokens > self.capacity:
            self._allocate(self.kv.budget_tokens)
        ctx = np.asarray(self.kv.context_slots(), dtype=np.int64)
        n_ctx = len(ctx)
        new_slots = np.asarray(adm.slots, dtype=np.int64)
        old = ctx[:-self.kv.tokens_per_frame]
        self._align_rotations(old, n_ctx)
        self._bias_base[:] = NEG_INF
        self._bias_base[old] = 0.0
        return adm, n_ctx, new_slots, int(ctx.max()) + 1

    def _chunk_result(self, frame_id, salient, gen, logits, adm, n_ctx, prefill_ms, decode_ms, t0,
                      forced_steps: int = 0) -> ChunkResult:
        """The decoded chunk ``gen`` / ``logits`` as a ChunkResult (and the engine's last_* diagnostics)."""
        self.last_logits = logits
        self.last_max_position = n_ctx + self.scratch_slots - 1
        self.last_max_rotation_position = self.last_max_position + self.delta
        bins = chunk_bins(self.cfg, gen)  # (H, action_dims)
        chunk = readout_actions(self.cfg, self.tokenizer, bins, logits, self.action_readout, forced_steps)
        t4 = time.perf_counter()
        return ChunkResult(frame_id=int(frame_id), token_ids=gen, action_bins=bins[0].copy(), action=chunk[0].copy(),
                           prefill_ms=prefill_ms, decode_ms=decode_ms, total_ms=(t4 - t0) * 1e3,
                           evicted_frames=list(adm.evicted), kv_occupancy_tokens=int(self.kv.occupancy_tokens),
                           salient=bool(salient), chunk=chunk, chunk_bins=bins, forced_steps=int(forced_steps))

    def _decode(self, gen: np.ndarray, logits: np.ndarray, n_ctx: int, r_end: int,
                forced: np.ndarray | None = None) -> None:
        """gen[1..] after the prefill (gen[0], logits[0] set): engine/numpy_decode.py, by vla.chunk_decode."""
        forced = np.full(len(gen), -1, np.int64) if forced is None else forced
        (decode_parallel if is_parallel(self.cfg) else decode_autoregressive)(self, gen, logits, n_ctx, r_end, forced)

    def _context_segment(self, new_slots: np.ndarray, r_end: int):
        """Attention segment over the context range [0, r_end): only the masked columns carry a bias —
        slots that are not visible (-inf: free slots, and the new tokens themselves) plus causal visibility
        among ``new_slots`` (rows = new tokens in order)."""
        n = len(new_slots)
        cols = np.nonzero(self._bias_base[:r_end] == NEG_INF)[0]
        if len(cols) == 0:
            return (0, r_end, None, None)
        vals = np.full((max(n, 1), len(cols)), NEG_INF, np.float32)
        if n:
            where = np.searchsorted(cols, new_slots)
            vals[:, where] = np.where(np.tri(n, dtype=bool), np.float32(0.0), NEG_INF)
        return (0, r_end, cols, vals)

    # ---- cache bookkeeping ----------------------------------------------------------------------------------
    def _apply_moves(self) -> None:
        """Copy K/V of frames the KVManager relocated on a budget shrink (set_budget)."""
        take = getattr(self.kv, "take_moves", None)
        for _fid, src, dst in (take() if take else []):
            src = np.asarray(src, dtype=np.int64)
            dst = np.asarray(dst, dtype=np.int64)
            self.k_pre[:, dst] = self.k_pre[:, src]
            for arr in (self.v, self.k_rot, self.k_norm):
                arr[:, :, dst] = arr[:, :, src]
            self.rot_pos[dst] = self.rot_pos[src]

    def _align_rotations(self, old: np.ndarray, n_ctx: int) -> None:
        """Pick ``delta`` and re-rotate the context keys that do not satisfy rot_pos == logical + delta."""
        n_old = len(old)
        logical = np.arange(n_old, dtype=np.int64)
        d = self.rot_pos[old] - logical
        limit = self.cfg.max_position_embeddings - (n_ctx + self.scratch_slots - 1)  # delta must stay below
        if n_old:
            vals, counts = np.unique(d, return_counts=True)
            delta = int(vals[np.argmax(counts)])
        else:
            delta = self.delta
        if not 0 <= delta < limit:
            delta = 0
        self.delta = delta
        stale = np.nonzero(d != delta)[0]
        self.rerotated_slots = len(stale)
        if len(stale) == 0:
            return
        slots = old[stale]
        pos = stale + delta
        cos = self.rope.cos[pos][:, None, :]
        sin = self.rope.sin_signed[pos][:, None, :]
        for layer in range(len(self.layers)):
            self.k_rot[layer][:, slots] = RopeTable.apply_tables(self.k_pre[layer, slots], cos, sin).transpose(1, 0, 2)
        self.rot_pos[slots] = pos

    # ---- forward --------------------------------------------------------------------------------------------
    def _lm_head(self, h: np.ndarray) -> np.ndarray:
        """(rows, hidden) -> (rows, n_action_bins) logits of the action rows."""
        return _rmsnorm(h.reshape(-1, self.hidden), self.final_norm, self.eps) @ self.head_t

    def _forward_tokens(self, x: np.ndarray, slots: np.ndarray, positions: np.ndarray, segments: list,
                        last_only: bool) -> np.ndarray:
        """Run n new tokens (embeddings ``x``) at logical ``positions``, writing their K/V into ``slots``.

        ``segments``: attention key ranges ``(start, end, cols, vals)`` over physical slots; ``vals`` is an
        additive bias, (rows, len(cols)) for the listed columns, or (rows, end-start) dense when ``cols`` is
        None, or no bias when both are None. The new tokens' own slots must lie inside a segment.
        Returns the final hidden rows (only the last row with ``last_only``: the last layer then computes
        attention / MLP for that row only, since the other rows' outputs feed nothing — their K/V of that
        layer come from its input).
        """
        part = CachePart(self, (0, len(slots)), self._placement(slots, positions), segments)
        return forward_parts(self.layers, self.cfg, x.copy(), [part], last_only)

    def _placement(self, slots: np.ndarray, positions: np.ndarray):
        """Where n new tokens go in this cache: (slots or a slice of them, cos, sin, rotation positions)."""
        n = len(slots)
        rpos = positions + self.delta
        cos = self.rope.cos[rpos][:, None, :]
        sin = self.rope.sin_signed[rpos][:, None, :]
        contiguous = n > 0 and int(slots[-1]) - int(slots[0]) == n - 1 and bool(np.all(np.diff(slots) == 1))
        return (slice(int(slots[0]), int(slots[0]) + n) if contiguous else slots), cos, sin, rpos

    def _store_kv(self, li: int, qkv: np.ndarray, place, last: bool) -> np.ndarray:
        """Layer ``li``'s per-cache part: write the K/V of the rows' ``qkv`` at ``place`` (_placement); return
        their rotated queries (n, H, D), or the last row's only (1, H, D) with ``last``."""
        n, (sl, cos, sin, _) = qkv.shape[0], place
        H, KV, D = self.H, self.KV, self.D
        hq, kvd = H * D, KV * D
        k = qkv[:, hq:hq + kvd].reshape(n, KV, D)
        self.k_pre[li, sl] = k
        self.v[li][:, sl] = qkv[:, hq + kvd:].reshape(n, KV, D).transpose(1, 0, 2)
        self.k_rot[li][:, sl] = RopeTable.apply_tables(k, cos, sin).transpose(1, 0, 2)
        self.k_norm[li][:, sl] = np.sqrt(np.einsum("nhd,nhd->hn", k, k))
        if last:
            return RopeTable.apply_tables(qkv[n - 1:, :hq].reshape(1, H, D), cos[n - 1:], sin[n - 1:])
        return RopeTable.apply_tables(qkv[:, :hq].reshape(n, H, D), cos, sin)

    def _attend(self, li: int, q: np.ndarray, segments: list) -> np.ndarray:
        """q (m, H, D) rotated -> attention output (m, H*D) over the key ranges in ``segments``.

        Scores are computed as ``K @ q.T`` -> (keys, G*m): OpenBLAS runs that shape 1.5-3x faster than
        ``q @ K.T`` for short query blocks, and the column sums go through BLAS (``ones @ p``). The usual
        max-subtraction is skipped when the Cauchy-Schwarz bound |q| * max|k| proves every score lies in
        [-SAFE, SAFE] (exp cannot overflow or underflow there, and softmax does not depend on the shift),
        saving two passes over the scores.
        """
        m = q.shape[0]
        KV, D, G = self.KV, self.D, self.G
        gm = G * m
        out = np.empty((m, KV, G, D), np.float32)
        qs = q * self.scale
        for j in range(KV):
            qjt = np.ascontiguousarray(qs[:, j * G:(j + 1) * G, :].transpose(2, 1, 0).reshape(D, gm))  # cols (g, i)
            kmax = max(float(self.k_norm[li, j, a:b].max()) for a, b, _, _ in segments)
            shift = float(np.sqrt(np.einsum("dc,dc->c", qjt, qjt).max())) * kmax > _SAFE_EXP
            probs = []
            mx = None
            for si, (a, b, cols, vals) in enumerate(segments):
                w = b - a
                if si == 0 and gm * w <= self._scores.size:
                    p = self._scores[:gm * w].reshape(w, gm)
                    np.matmul(self.k_rot[li, j, a:b], qjt, out=p)
                else:
                    p = self.k_rot[li, j, a:b] @ qjt
                if vals is not None:
                    p3 = p.reshape(w, G, m)
                    if cols is None:
                        p3 += vals.T[:, None, :]
                    else:
                        p3[cols] += vals.T[:, None, :]
                if shift:
                    cmax = p.max(axis=0)
                    mx = cmax if mx is None else np.maximum(mx, cmax)
                probs.append(p)
            den = np.zeros(gm, np.float32)
            acc = np.zeros((gm, D), np.float32)
            for p, (a, b, _, _) in zip(probs, segments):
                if mx is not None:
                    p -= mx
                np.exp(p, out=p)
                den += self._ones[:b - a] @ p  # BLAS gemv: 4x faster than p.sum(axis=0)
                acc += p.T @ self.v[li, j, a:b]
            acc /= den[:, None]
            out[:, j] = acc.reshape(G, m, D).transpose(1, 0, 2)
        return out.reshape(m, KV * G * D)
