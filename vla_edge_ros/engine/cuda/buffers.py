"""The CUDA engine's device memory: weights (uploaded once), activations (fixed, so graphs can be captured over
them) and the KV cache (reallocated when the budget grows).

Every allocation goes through one VramTracker (named, counted, limited by max_vram_gb). Device pointers are plain
ints: kernel arguments are frozen when a graph is captured, so everything that changes between chunks (slot list,
lengths, positions, the frame's rows) lives in these buffers and is written by async copies before the replay.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from vla_edge_ros.engine.config import ModelConfig
from vla_edge_ros.engine.cuda.pass_meta import (META_INTS, PARALLEL_RECORD, chunk_meta, forced_at, meta_ints,
                                                meta_record, parallel_tiles, pass_tiles)
from vla_edge_ros.engine.cuda.plan import T_CHUNK, padded_intermediate
from vla_edge_ros.engine.cuda.vram import VramTracker
from vla_edge_ros.engine.geometry import chunk_action_tokens, is_parallel, parallel_slot_token
from vla_edge_ros.engine.interface import EngineError
from vla_edge_ros.engine.quant import GROUP_SIZE


def f32_to_bf16_bits(a: np.ndarray) -> np.ndarray:
    from vla_edge_ros.engine.checkpoint import f32_to_bf16_bits as convert
    return convert(np.asarray(a, dtype=np.float32))


def as_bf16_bits(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a)
    return np.ascontiguousarray(a) if a.dtype == np.uint16 else f32_to_bf16_bits(a)


def bf16_bits_to_f32(a: np.ndarray) -> np.ndarray:
    return (np.asarray(a, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def interleave_gate_up(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """Rows 16b..16b+7 = gate rows 8b..8b+7, rows 16b+8..16b+15 = up rows 8b..8b+7 (the SiLU epilogue layout)."""
    inter, h = gate.shape
    if inter % 8:
        raise EngineError(f"intermediate_size={inter} must be a multiple of 8 for the fused gate/up kernels")
    out = np.empty((inter // 8, 2, 8, h), dtype=gate.dtype)
    out[:, 0] = gate.reshape(inter // 8, 8, h)
    out[:, 1] = up.reshape(inter // 8, 8, h)
    return out.reshape(2 * inter, h)


class DeviceMemory:
    """Named device allocations (VramTracker) as int pointers, optionally filled from the host."""

    def __init__(self, cuda, limit_bytes: int):
        self.cuda = cuda
        self.tracker = VramTracker(cuda.mem_alloc, limit_bytes=limit_bytes)

    def alloc(self, name: str, nbytes: int, host: np.ndarray | None = None) -> int:
        buf = self.tracker.alloc(name, nbytes)
        if host is not None:
            host = np.ascontiguousarray(host)
            if host.nbytes != nbytes:
                raise EngineError(f"upload of {name}: {host.nbytes} bytes for a {nbytes}-byte buffer")
            self.cuda.memcpy_htod(buf, host)
        return int(buf)

    def zeros(self, name: str, shape, dtype) -> int:
        a = np.zeros(shape, dtype)
        return self.alloc(name, a.nbytes, a)

    def free(self, name: str) -> None:
        self.tracker.free(name)


class LayerWeights(NamedTuple):
    wqkv: int  # [q; k; v] rows, bf16 [nqkv][H]
    bqkv: int  # fp32 [nqkv]
    wo: int    # bf16 [H][Hq HD]
    wgu: int   # gate/up interleaved in blocks of 8 rows (interleave_gate_up), bf16 [2I][H]
    wd: int    # bf16 [H][I]
    ln1: int   # bf16 [H]
    ln2: int
    # quantised weights (issue 23): the four matrices above hold codes in the same row layouts (int8 / fp8: one
    # byte per weight; int4: two per byte, rows of K / 2 bytes), these their float32 scales (int8 / fp8: per row;
    # int4: per row and group of 128 columns) and the int4 uint8 zero points, in the same row order ([q; k; v],
    # interleaved gate/up); 0 for bf16 weights (and for the zero points of int8 / fp8)
    sqkv: int = 0
    so: int = 0
    sgu: int = 0
    sd: int = 0
    zqkv: int = 0
    zo: int = 0
    zgu: int = 0
    zd: int = 0


class LinearCodes(NamedTuple):
    """A linear weight as the kernels take it: bf16 bits (scales and zeros None), or a QuantizedLinear's codes
    (out, in) -- int4: (out, in / 2) bytes -- with its float32 scales and (int4) uint8 zero points."""
    codes: np.ndarray
    scales: np.ndarray | None = None
    zeros: np.ndarray | None = None

    def rows(self, other: "LinearCodes") -> "LinearCodes":
        """self's rows, then other's (the [q; k; v] concatenation)."""
        cat = (lambda a, b: None if a is None else np.concatenate([a, b], axis=0))
        return LinearCodes(cat(self.codes, other.codes), cat(self.scales, other.scales), cat(self.zeros, other.zeros))

    def pad_rows(self, n: int) -> "LinearCodes":
        """n zero rows more (gate / up at the padded intermediate size): zero codes, scale 0, zero point 0."""
        pad = (lambda a: None if a is None else np.pad(a, ((0, n),) + ((0, 0),) * (a.ndim - 1)))
        return LinearCodes(pad(self.codes), pad(self.scales), pad(self.zeros))

    def pad_columns(self, n: int, k: int) -> "LinearCodes":
        """n input columns more after the k there are (down at the padded intermediate size): zero codes; int4's
        groups grow to cover them with scale 0 (the activations there are exact zeros anyway)."""
        per_col = self.codes.shape[1] / k  # code elements per column: 1, or 1/2 for int4 (n is even)
        codes = np.pad(self.codes, ((0, 0), (0, int(n * per_col))))
        if self.scales is None or self.scales.ndim == 1:
            return LinearCodes(codes, self.scales, self.zeros)
        extra = -(-(k + n) // GROUP_SIZE) - self.scales.shape[1]
        grow = (lambda a: np.pad(a, ((0, 0), (0, extra))))
        return LinearCodes(codes, grow(self.scales), grow(self.zeros))


def _linear_codes(w: dict[str, Any], name: str) -> LinearCodes:
    v = w[name]
    codes = getattr(v, "codes", None)
    if codes is None:
        return LinearCodes(as_bf16_bits(v))
    if v.weight_dtype == "int4" and v.group_size != GROUP_SIZE:  # cuda/wtype.cuh WT_GROUP
        raise EngineError(f"{name}: the CUDA int4 kernels take groups of {GROUP_SIZE} columns, not {v.group_size}")
    zeros = None if v.zeros is None else np.ascontiguousarray(v.zeros, dtype=np.uint8)
    return LinearCodes(np.ascontiguousarray(codes), np.ascontiguousarray(v.scales, dtype=np.float32), zeros)


class Weights:
    """The model on the device in the kernels' layouts (built on the host once), and the patch embedder. The
    linear weights are bf16 bits, or QuantizedLinear codes with their scales (and int4 zero points): int8 / fp8 /
    int4; the embedding, norms, biases, head and vision stay bf16 (docs/QUANTIZATION.md)."""

    def __init__(self, mem: DeviceMemory, cfg: ModelConfig, w: dict[str, Any], prefix_ids: np.ndarray):
        H, I = cfg.hidden_size, padded_intermediate(cfg)
        pad = I - cfg.intermediate_size  # zero gate / up rows and down columns (plan.padded_intermediate)
        self.layers: list[LayerWeights] = []
        self.quantized = False

        def put(name: str, a: np.ndarray | None) -> int:
            return 0 if a is None else mem.alloc(name, a.nbytes, a)

        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            q, k, v = (_linear_codes(w, p + f"self_attn.{n}_proj.weight") for n in "qkv")
            qkv = q.rows(k).rows(v)
            bqkv = np.concatenate([bf16_bits_to_f32(w[p + f"self_attn.{n}_proj.bias"]) for n in "qkv"])
            o = _linear_codes(w, p + "self_attn.o_proj.weight")
            gate, up, down = (_linear_codes(w, p + f"mlp.{n}_proj.weight") for n in ("gate", "up", "down"))
            if pad:  # zero codes with scale 0 are zero weights in every type (gate / up rows, down columns)
                gate, up = gate.pad_rows(pad), up.pad_rows(pad)
                down = down.pad_columns(pad, cfg.intermediate_size)
            # codes, scales and zero points interleaved alike (per-row scales are 1-D: they stay 1-D)
            il = (lambda a, b: None if a is None else interleave_gate_up(
                a.reshape(len(a), -1), b.reshape(len(b), -1)).reshape((2 * len(a),) + a.shape[1:]))
            gu = LinearCodes(il(gate.codes, up.codes), il(gate.scales, up.scales), il(gate.zeros, up.zeros))
            self.quantized = qkv.scales is not None
            self.layers.append(LayerWeights(
                wqkv=put(f"L{i}.wqkv", qkv.codes),
                bqkv=mem.alloc(f"L{i}.bqkv", bqkv.nbytes, bqkv.astype(np.float32)),
                wo=put(f"L{i}.wo", o.codes), wgu=put(f"L{i}.wgu", gu.codes), wd=put(f"L{i}.wd", down.codes),
                ln1=mem.alloc(f"L{i}.ln1", 2 * H, w[p + "input_layernorm.weight"]),
                ln2=mem.alloc(f"L{i}.ln2", 2 * H, w[p + "post_attention_layernorm.weight"]),
                sqkv=put(f"L{i}.sqkv", qkv.scales), so=put(f"L{i}.so", o.scales), sgu=put(f"L{i}.sgu", gu.scales),
                sd=put(f"L{i}.sd", down.scales), zqkv=put(f"L{i}.zqkv", qkv.zeros), zo=put(f"L{i}.zo", o.zeros),
                zgu=put(f"L{i}.zgu", gu.zeros), zd=put(f"L{i}.zd", down.zeros)))
        emb = w["model.embed_tokens.weight"]
        self.embed = mem.alloc("embed", emb.nbytes, emb)
        self.final_norm = mem.alloc("final_norm", 2 * H, w["model.norm.weight"])
        off = cfg.action_token_offset
        if cfg.tie_word_embeddings:
            self.head_rows = self.embed + 2 * off * H  # the action rows of the LM head (its last n_action_bins)
        else:
            rows = np.ascontiguousarray(w["lm_head.weight"][off:])
            self.head_rows = mem.alloc("lm_head_action_rows", rows.nbytes, rows)
        self.prefix_embed = bf16_bits_to_f32(emb[prefix_ids]) if len(prefix_ids) else None
        # vision patch embedder: patchify on the host, the projection as a GEMM on the device
        from vla_edge_ros.engine.vision import PatchEmbedder
        vis = {k: bf16_bits_to_f32(w[k]) for k in ("vision.patch_embed.weight", "vision.patch_embed.bias",
                                                    "vision.pos_embed") if k in w}
        self.vision = PatchEmbedder(cfg, vis if len(vis) == 3 else None)
        wpatch = f32_to_bf16_bits(self.vision.weight_t.T)  # (hidden, patch_dim)
        self.w_patch = mem.alloc("vision.w", wpatch.nbytes, wpatch)
        bias_pos = np.zeros((T_CHUNK, H), np.float32)
        bias_pos[:cfg.n_patches] = self.vision.bias_pos
        self.vis_bias_pos = mem.alloc("vision.bias_pos", bias_pos.nbytes, bias_pos)
        # the parallel pass's input (vla.chunk_decode "parallel"): every slot is the embedding of one constant token,
        # so its rows (the A slots', then zeros to the last tile's end) are built once and copied into the
        # prefill rows on the device before each pass (a dtod copy inside its graph, no host data per chunk)
        self.parallel_rows = 0
        if is_parallel(cfg):
            rows = np.zeros((T_CHUNK * parallel_tiles(cfg), H), np.float32)  # whole tiles: padding rows finite
            rows[:chunk_action_tokens(cfg)] = bf16_bits_to_f32(emb[parallel_slot_token(cfg)])
            self.parallel_rows = mem.alloc("parallel_rows", rows.nbytes, rows)


class Activations:
    """Fixed buffers of one chunk (graph-static) and the pinned host staging of its per-chunk copies."""

    def __init__(self, mem: DeviceMemory, cfg: ModelConfig, scratch_slots: int):
        """scratch_slots: the chunk's decode tokens (engine/geometry.chunk_scratch_slots): S autoregressive decode
        steps, or the A parallel slots; logits / tok_buf hold one row more (gen[0], the prefill's)."""
        cuda = mem.cuda
        # the parallel pass's row tiles (pass_meta.parallel_tiles: 1 for an autoregressive chunk); the buffers' rows:
        # the frame's tile, then a parallel chunk's slot tiles (pass_meta.pass_tiles: the fused pass uses them all)
        self.tiles = parallel_tiles(cfg)
        H, I, T, n_bins = cfg.hidden_size, padded_intermediate(cfg), T_CHUNK * pass_tiles(cfg), cfg.n_action_bins
        nq = cfg.num_attention_heads * cfg.head_dim
        nqkv = nq + 2 * cfg.num_key_value_heads * cfg.head_dim
        # prefill-shaped passes: the residual stream of the T rows (fp32), its normed bf16 copy, QKV, attention,
        # MLP activations
        self.x_pre = mem.zeros("x_pre", (T, H), np.float32)
        self.h_bf = mem.zeros("h_bf", (T, H), np.uint16)
        self.qkv = mem.zeros("qkv", (T, nqkv), np.float32)
        self.attn_bf = mem.alloc("attn_bf", 2 * T * nq)
        self.act_bf = mem.alloc("act_bf", 2 * T * I)
        self.final_h = mem.alloc("final_h", 4 * T * H)
        # decode: one token's vectors (fp32)
        self.x_dec = mem.alloc("x_dec", 4 * H)
        self.q_dec = mem.alloc("q_dec", 4 * nq)
        self.attn_dec = mem.alloc("attn_dec", 4 * nq)
        self.act_dec = mem.alloc("act_dec", 4 * I)
        self.final_h_dec = mem.alloc("final_h_dec", 4 * scratch_slots * H)
        # outputs: action-row logits of the prefill and every decode step, the greedy tokens
        self.logits = mem.alloc("logits", 4 * (scratch_slots + 1) * n_bins)
        self.tok_buf = mem.alloc("tok_buf", 4 * (scratch_slots + 1))
        # host-written ints (pass_meta.chunk_meta): the frame prefill's record [L keys seen, p0, T rows, n_ctx,
        # bidirectional, ...] (the decode reads it too), the parallel pass's record, forced[gen] (-1 = free)
        n_meta = meta_ints(scratch_slots + 1, self.tiles)
        empty = chunk_meta(scratch_slots + 1, meta_record(0, 0, 0, 0), tiles=self.tiles)  # nothing forced yet
        self.meta = mem.alloc("meta", empty.nbytes, empty)
        self.meta_parallel = self.meta + 4 * PARALLEL_RECORD  # tile 0's; tile t's: meta_tile(t)
        self.forced = self.meta + 4 * forced_at(self.tiles)
        self.vis_in = mem.zeros("vision.patches", (T_CHUNK, cfg.patch_dim), np.uint16)
        self.vis_out = mem.alloc("vision.out", 4 * T_CHUNK * H)
        self.h_x = cuda.pagelocked_zeros((T_CHUNK, H), np.float32)  # a frame's rows (x_pre's first tile)
        self.h_meta = cuda.pagelocked_zeros(n_meta, np.int32)
        self.h_tok = cuda.pagelocked_zeros(scratch_slots + 1, np.int32)
        self.h_logits = cuda.pagelocked_zeros((scratch_slots + 1, n_bins), np.float32)


    def meta_tile(self, t: int) -> int:
        """Device pointer of the parallel pass's record of row tile t (pass_meta.parallel_records)."""
        return self.meta_parallel + 4 * META_INTS * int(t)


class KVCache:
    """bf16 K and V ``[layers][budget + scratch_slots][kv_heads * head_dim]`` stored BEFORE RoPE (keys are rotated in
    the attention kernels from each slot's logical position, so eviction never touches a stored key), the slot list,
    the RoPE table and the attention kernels' split partials."""

    _SIZED = ("key_slots", "rope", "part_o_pf", "part_ml_pf", "part_o_dec", "part_ml_dec")

    def __init__(self, mem: DeviceMemory, cfg: ModelConfig, scratch_slots: int, keys_per_split: int):
        self.mem, self.cfg, self.scratch_slots, self.kps = mem, cfg, scratch_slots, keys_per_split
        self.nkv = cfg.num_key_value_heads * cfg.head_dim
        self.capacity = self.slots = 0
        self.kc = self.vc = 0
        self.move_buf: int | None = None

    def allocate(self, capacity: int) -> None:
        """Room for ``capacity`` retained tokens; a second call (budget growth) keeps every retained row."""
        mem, cuda, cfg = self.mem, self.mem.cuda, self.cfg
        L, HD, old_slots = cfg.num_hidden_layers, cfg.head_dim, self.slots
        S = int(capacity) + self.scratch_slots  # the retained tokens, then the scratch slots (steps / parallel slots)
        kv_bytes = 2 * L * S * self.nkv
        grow = self.kc != 0
        kc = mem.alloc("kc_new" if grow else "kc", kv_bytes)
        vc = mem.alloc("vc_new" if grow else "vc", kv_bytes)
        cuda.memset_d16(kc, 0, kv_bytes // 2)
        cuda.memset_d16(vc, 0, kv_bytes // 2)
        if grow:  # every layer's first old_slots rows
            row = 2 * self.nkv
            for layer in range(L):
                for src, dst in ((self.kc, kc), (self.vc, vc)):
                    cuda.memcpy_dtod(dst + layer * S * row, src + layer * old_slots * row, old_slots * row)
            for name in ("kc", "vc") + self._SIZED:
                mem.free(name)
            live = mem.tracker._live
            live["kc"], live["vc"] = live.pop("kc_new"), live.pop("vc_new")
        self.kc, self.vc, self.capacity, self.slots = kc, vc, int(capacity), S
        self.key_slots = mem.zeros("key_slots", S + 8, np.int32)
        self.h_slots = cuda.pagelocked_zeros(S + 8, np.int32)
        inv = 1.0 / (float(cfg.rope_theta) ** (np.arange(0, HD, 2, dtype=np.float64) / HD))
        ang = np.arange(S + 64, dtype=np.float64)[:, None] * inv[None, :]
        cs = np.empty((S + 64, HD // 2, 2), np.float32)  # (cos, sin) per position and dim pair
        cs[..., 0], cs[..., 1] = np.cos(ang), np.sin(ang)
        self.rope = mem.alloc("rope", cs.nbytes, cs)
        self.nsplit = -(-S // self.kps)
        rows_pf, Hq = cfg.num_attention_heads * T_CHUNK, cfg.num_attention_heads
        self.part_o_pf = mem.alloc("part_o_pf", 4 * self.nsplit * rows_pf * HD)
        self.part_ml_pf = mem.alloc("part_ml_pf", 8 * self.nsplit * rows_pf)
        self.part_o_dec = mem.alloc("part_o_dec", 4 * self.nsplit * Hq * HD)
        self.part_ml_dec = mem.alloc("part_ml_dec", 8 * self.nsplit * Hq)

    def layer(self, i: int) -> tuple[int, int]:
        """Device pointers of layer i's K and V rows."""
        off = i * self.slots * self.nkv * 2
        return self.kc + off, self.vc + off

    def upload_moves(self, moves: list[Any]) -> tuple[int, int, int]:
        """The (src, dst) slot pairs of a budget shrink's relocations on the device: (src ptr, dst ptr, count)."""
        src = np.concatenate([np.asarray(m[1], np.int32) for m in moves])
        dst = np.concatenate([np.asarray(m[2], np.int32) for m in moves])
        if self.move_buf is not None:
            self.mem.free("moves")
        self.move_buf = self.mem.alloc("moves", 8 * len(src), np.concatenate([src, dst]))
        return self.move_buf, self.move_buf + 4 * len(src), len(src)
