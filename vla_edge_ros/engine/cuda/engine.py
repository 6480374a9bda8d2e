"""CudaEngine: the Engine interface on the GPU: kernels compiled at start-up, weights uploaded once, one chunk = two
CUDA graph replays (the prefill pass, then the decode steps, or the parallel pass) on one stream.

Set-up order: refuse what cannot run (geometry, VRAM budget) before any allocation; compile; plan the launches
(plan.py) from the compiled kernels' constants and the device's limits; upload; prefill the pinned instruction
prefix eagerly; capture the two graphs. A chunk: the KV manager admits the frame, the host writes the frame's rows,
the slot list and ``meta`` (pass_meta.chunk_meta: a record per pass and the forced prefix) by async copies, replays both
graphs and reads back the tokens and logits. The greedy chain stays on the device (each step's argmax feeds the next
step's embedding gather).

Decode steps: ``decode_steps`` = S (engine/geometry.chunk_decode_steps; the token layout of engine/interface.py),
not the ``decode_tokens`` parameter, sizes the activations, the KV scratch slots, the memory plan and the decode
graph: an action chunk of H > 1 actions (``vla.action_horizon``) is S = max(decode_tokens, H * action_dims + 1)
greedy steps in the same graph, and its bins come back as ``ChunkResult.chunk_bins`` (H, action_dims).

Parallel decoding (issue 22, ``vla.chunk_decode: parallel``; engine/interface.py): the second graph is the
"parallel" pass instead of the decode steps: a prefill-shaped pass over the A = action_horizon x action_dims slot
rows (``forward.parallel``). Its input rows are constant (every slot is the embedding of
geometry.parallel_slot_token), uploaded once (Weights.parallel_rows) and copied into the prefill rows by a
device-to-device copy captured at the head of its graph; its meta record (positions n_ctx .., keys = context + the A
scratch slots, bidirectional) is written with the frame's in the one meta copy before the replays. Why a graph of
its own rather than the prefill graph replayed with other meta: the head differs (all A rows, not the last one), the
record differs, and the event between the two graphs times it as ``decode_ms`` (the cost model counts the pass as
one decode step: ``decode_steps`` = 1; ``scratch_slots`` = A sizes the buffers). Cost: about one prefill pass per
32-row tile of slots (pass_meta.parallel_tiles: H = 4 x 7 is one tile, H = 8 x 7 two; each tile's GEMMs read every
weight, forward._layers); more than PARALLEL_MAX_TILES tiles are refused by name (pass_meta.parallel_slots_problem).
Tuning ``fused_parallel``: ONE graph instead ("fused", forward.fused): the frame's rows and the slot rows in one
pass, each GEMM over all of them (its time is the chunk's prefill_ms; decode_ms is 0).

Forced prefix (``run_chunk(forced_bins=...)``, geometry.forced_gen): the forced ids go to the device in the meta
copy, and every argmax writes the forced id where there is one (the logits stay the computed ones). In the decode
chain the next step embeds that id: teacher forcing, as numpy_decode.decode_autoregressive; in the parallel pass no
slot reads another's choice, so it just replaces the choices (numpy's copyto). Nothing forced: all -1.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from vla_edge_ros.engine.config import ModelConfig
from vla_edge_ros.engine.cuda import forward
from vla_edge_ros.engine.cuda.buffers import Activations, DeviceMemory, KVCache, Weights, f32_to_bf16_bits
from vla_edge_ros.engine.cuda.device import DeviceEngine
from vla_edge_ros.engine.cuda.kernels import Launcher
from vla_edge_ros.engine.cuda.pass_meta import chunk_meta, meta_record, parallel_records, parallel_slots_problem
from vla_edge_ros.engine.cuda.plan import (BLOCK, KERNEL_SUFFIX, T_CHUNK, Launch, Tuning, for_weight_dtype,
                                           padded_intermediate, plan)
from vla_edge_ros.engine.cuda.probe import cuda_status
from vla_edge_ros.engine.cuda.vram import check_budget, memory_plan, quantized_model_bytes
from vla_edge_ros.engine.geometry import (check_action_readout, check_chunk_geometry, check_forced_bins, chunk_bins,
                                          chunk_decode_steps, chunk_scratch_slots, forced_gen, is_parallel,
                                          readout_actions)
from vla_edge_ros.engine.interface import ChunkResult, Engine, EngineError, check_vision_tokens
from vla_edge_ros.engine.quant import WEIGHT_DTYPES


def unsupported_reason(cfg: ModelConfig, weight_dtype: str = "bf16") -> str | None:
    """Why the CUDA backend refuses this model / weight type at configure (None: it does not). Pure, so the
    refusal is tested without a GPU. The kernels take every weight type of engine/quant.py (plan.KERNEL_SUFFIX);
    both chunk shapes (vla.action_start token / prefill) run: the graphs are sized by geometry.chunk_scratch_slots
    and the bins read by geometry.chunk_bins; parallel chunks of up to PARALLEL_MAX_TILES x T_CHUNK slots run (more:
    refused here, by name, as by ``chunk_support_problem``)."""
    if weight_dtype not in WEIGHT_DTYPES:
        return f"weight_dtype={weight_dtype!r} is not one of {', '.join(WEIGHT_DTYPES)}"
    if weight_dtype not in KERNEL_SUFFIX:  # a type engine/quant.py gained and cuda/wtype.cuh has not
        return (f"weight_dtype={weight_dtype!r}: the CUDA backend's GEMV / skinny-GEMM kernels take "
                f"{', '.join(KERNEL_SUFFIX)} weights; use backend numpy for {weight_dtype}")
    return parallel_slots_problem(cfg)


def defines_problem(cfg: ModelConfig, weight_dtype: str, defines: Sequence[str]) -> str | None:
    """Why a measuring build (-D knobs, $VLA_CUDA_DEFINES) cannot run this model, None when it can. Pure."""
    if weight_dtype == "int4" and "GEMM_I4_PAIR=1" in defines:  # units of 64 columns (cuda/gemm_quant.cu)
        bad = [f"{name} {k}" for name, k in (("hidden", cfg.hidden_size), ("intermediate", padded_intermediate(cfg)))
               if k % 64]
        if bad:
            return f"GEMM_I4_PAIR=1 needs the prefill GEMMs' K to be a multiple of 64, not {', '.join(bad)}"
    return None


class CudaEngine(DeviceEngine, Engine):
    name = "cuda"
    host_profile_ms: dict[str, float] = {}  # the last chunk's host-time split: admit, inputs, launch, wait

    def __init__(self, cfg: ModelConfig, checkpoint: str | Path | Mapping[str, np.ndarray], kv,
                 instruction: str = "", decode_tokens: int = 8, max_vram_gb: float = 8.0,
                 log: Callable[[str], None] = print, use_graphs: bool = True,
                 tuning: Tuning | Mapping[str, Any] | None = None, defines: Sequence[str] = (),
                 weight_dtype: str = "bf16", action_readout: str = "argmax"):
        """tuning: plan.Tuning (or a mapping of its fields); defines: compile-time macros for benchmark builds
        (e.g. VLA_TIMELINE), added to $VLA_CUDA_DEFINES. $VLA_CUDA_ARCH=compute_80 builds the pre-Hopper path.
        weight_dtype: bf16 / int8 / fp8 / int4 (``unsupported_reason``): a bf16 checkpoint is quantised at load,
        a pre-quantised one (engine/quant_checkpoint.py) is read as it is."""
        problem = unsupported_reason(cfg, weight_dtype)
        if problem:
            raise EngineError(f"CUDA backend refuses the model: {problem}")
        self.weight_dtype = weight_dtype
        ok, why = cuda_status()
        if not ok:
            raise EngineError(f"CUDA backend unavailable: {why}")
        import pycuda.driver as cuda
        self._cuda, self.cfg, self.kv, self.log = cuda, cfg, kv, log
        self.action_readout = check_action_readout(action_readout)  # host-side, from h_logits (geometry.py)
        self.use_graphs = bool(use_graphs)
        self.tuning = tuning if isinstance(tuning, Tuning) else Tuning.from_mapping(tuning)
        self.decode_tokens, self.max_vram_gb = int(decode_tokens), float(max_vram_gb)
        self.decode_steps = chunk_decode_steps(cfg, self.decode_tokens)  # S (parallel: 1): what the cost model counts
        self.scratch_slots = chunk_scratch_slots(cfg, self.decode_tokens)  # S, or the A parallel slots: sizes buffers
        self.parallel = is_parallel(cfg)
        self.defines = tuple(defines) + tuple(os.environ.get("VLA_CUDA_DEFINES", "").split())
        problem = defines_problem(cfg, weight_dtype, self.defines)
        if problem:
            raise EngineError(f"CUDA backend refuses the build: {problem}")
        self.prefix_ids = check_chunk_geometry(cfg, kv, instruction, self.decode_tokens)
        if kv.tokens_per_frame > T_CHUNK:
            raise EngineError(f"tokens_per_frame={kv.tokens_per_frame}: the CUDA prefill handles at most "
                              f"{T_CHUNK} tokens per frame")
        from vla_edge_ros.core.action_tokenizer import ActionTokenizer
        self.tokenizer = ActionTokenizer(cfg.vocab_size, cfg.action_q01, cfg.action_q99, cfg.n_action_bins)
        self._open_device(cfg, lambda: self._setup(checkpoint))  # device.DeviceEngine

    # ---- set-up ------------------------------------------------------------------------------------------
    def _setup(self, checkpoint) -> None:
        cuda, cfg = self._cuda, self.cfg
        t0 = time.perf_counter()
        capacity = int(self.kv.budget_tokens)
        sizes = memory_plan(cfg, capacity, self.scratch_slots)
        total = check_budget(self._model_bytes(sizes), sizes["kv"], sizes["scratch"], self.max_vram_gb)
        self.mem = DeviceMemory(cuda, int(self.max_vram_gb * 2**30))
        w = self._load_weights(checkpoint)
        t1 = time.perf_counter()
        self._compile(self.defines)
        self._plan()
        t2 = time.perf_counter()
        self.weights = Weights(self.mem, cfg, w, self.prefix_ids)
        del w
        self.act = Activations(self.mem, cfg, self.scratch_slots)
        self.kvc = KVCache(self.mem, cfg, self.scratch_slots, self.plan.keys_per_split)
        self.kvc.allocate(capacity)
        self.stream = cuda.Stream()
        self.ev = [cuda.Event() for _ in range(4)]
        self.launcher = Launcher(self.kernels, self.stream, self.plan.pdl)
        t3 = time.perf_counter()
        self._prefill_prefix()
        self._capture()
        self.stream.synchronize()
        t4 = time.perf_counter()
        self.last_logits: np.ndarray | None = None
        self.log(f"cuda engine: {self.device_name}, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
                 f"budget {capacity} tokens; device memory {self.mem.tracker.current_bytes / 2**30:.3f} GiB (planned "
                 f"{total / 2**30:.3f}); load {t1 - t0:.1f}s, compile {t2 - t1:.1f}s, upload {t3 - t2:.1f}s, "
                 f"prefix+capture {t4 - t3:.1f}s, graphs {'on' if self.use_graphs else 'off'}; kernels "
                 f"{self.arch.describe()}, PDL {'on' if self.plan.pdl else 'off'}")

    def _model_bytes(self, sizes: Mapping[str, int]) -> int:
        """memory_plan's model part with the linear weights at their size in ``weight_dtype`` (vram.py)."""
        return quantized_model_bytes(sizes["model"], self.cfg, self.weight_dtype, padded_intermediate(self.cfg))

    def _plan(self) -> None:
        """Plan the launches for the current tuning and apply what the kernels need from it (shared-memory limits,
        the late-trigger mask in every module)."""
        p = for_weight_dtype(plan(self.cfg, self.tuning, self.limits), self.weight_dtype, self.cfg,
                             self.limits.constants)
        for note in p.notes:
            self.log(f"cuda engine: {note}")
        self._apply_plan(p)

    def retune(self, **changes: Any) -> None:
        """Change tuning (plan.Tuning fields; ``use_graphs``) and re-capture the graphs (benchmarks)."""
        with self._active():
            self.stream.synchronize()
            if "use_graphs" in changes:
                self.use_graphs = bool(changes.pop("use_graphs"))
            self.tuning = self.tuning.with_changes(**changes)
            self._plan()
            self.launcher.pdl = self.plan.pdl
            self._capture()
            self.stream.synchronize()

    @property
    def pdl(self) -> bool:
        """Kernels are launched with programmatic dependent launch (sm_90 build, driver support, tuning)."""
        return self.plan.pdl

    # ---- the forward pass, eagerly or into graphs -----------------------------------------------------------
    def enqueue_prefill(self, k=None) -> None:
        forward.prefill(k or self.launcher, self.plan, self.cfg, self.weights, self.act, self.kvc)

    def enqueue_decode(self, k=None) -> None:
        forward.decode(k or self.launcher, self.plan, self.cfg, self.weights, self.act, self.kvc, self.decode_steps)

    def enqueue_parallel(self, k=None) -> None:
        """The parallel pass: the slots' constant input rows copied into the prefill rows (on the stream, so a graph
        capture records the copy as its first node: the frame prefill has overwritten them), then its launches."""
        self._cuda.memcpy_dtod_async(self.act.x_pre, self.weights.parallel_rows,
                                     4 * T_CHUNK * self.act.tiles * self.cfg.hidden_size, self.stream)
        forward.parallel(k or self.launcher, self.plan, self.cfg, self.weights, self.act, self.kvc, self.scratch_slots)

    def enqueue_fused(self, k=None) -> None:
        """A parallel chunk as one pass (tuning fused_parallel): the slots' input rows copied after the frame's rows
        (on the stream: a graph records the copy as its first node), then the frame's and the slots' launches."""
        T, H = T_CHUNK, self.cfg.hidden_size
        self._cuda.memcpy_dtod_async(self.act.x_pre + 4 * T * H, self.weights.parallel_rows,
                                     4 * T * self.act.tiles * H, self.stream)
        forward.fused(k or self.launcher, self.plan, self.cfg, self.weights, self.act, self.kvc, self.scratch_slots)

    @property
    def fused(self) -> bool:
        """A parallel chunk runs as ONE pass (plan.fused_parallel), not the prefill then the parallel pass."""
        return self.parallel and self.plan.fused_parallel

    def _passes(self) -> list[tuple[str, Callable[..., None]]]:
        """A chunk's graphs in order and what fills each: the prefill, then the decode steps or the parallel pass;
        or the fused pass alone. The first one's time is a chunk's prefill_ms, the rest's its decode_ms."""
        if self.fused:
            return [("fused", self.enqueue_fused)]
        return [("prefill", self.enqueue_prefill),
                ("parallel", self.enqueue_parallel) if self.parallel else ("decode", self.enqueue_decode)]

    def enqueue_chunk(self, k=None) -> None:
        """A whole chunk's launches through launcher k (profiling tools record or filter them)."""
        for _, enqueue in self._passes():
            enqueue(k)

    def _capture(self) -> None:
        from vla_edge_ros.engine.cuda.graphs import CudaGraph
        for g in self._graphs.values():
            g.destroy()
        self._graphs = {}
        if not self.use_graphs:
            return
        self.stream.synchronize()
        for name, enqueue in self._passes():
            self._graphs[name] = CudaGraph(name).capture(self.stream, enqueue)

    def _run(self, name: str, enqueue: Callable[[], None]) -> None:
        if self.use_graphs:
            self._graphs[name].launch(self.stream)
        else:
            enqueue()

    # ---- host-side inputs --------------------------------------------------------------------------------
    def _set_inputs(self, rows: np.ndarray, slots: np.ndarray, L: int, p0: int, T: int, n_ctx: int,
                    forced: np.ndarray | None = None, parallel: bool = False) -> None:
        """The prefill's rows, the slot list and the meta buffer (pass_meta.chunk_meta: this pass's record, the parallel
        pass's when ``parallel``, geometry.forced_gen's ``forced`` ids or none) by async copies on the stream."""
        cuda, a, kv = self._cuda, self.act, self.kvc
        a.h_x[:T] = rows
        a.h_x[T:] = 0.0  # (the prefix's last partial chunk; a frame fills all 32 rows)
        n = len(slots)
        kv.h_slots[:n] = slots
        a.h_meta[:] = chunk_meta(len(a.h_tok), meta_record(L, p0, T, n_ctx),
                                 parallel_records(n_ctx, self.scratch_slots) if parallel else None, forced, a.tiles)
        cuda.memcpy_htod_async(a.x_pre, a.h_x, self.stream)
        cuda.memcpy_htod_async(kv.key_slots, kv.h_slots[:max(n, 1)], self.stream)
        cuda.memcpy_htod_async(a.meta, a.h_meta, self.stream)

    def _prefill_prefix(self) -> None:
        """The pinned instruction prefix, in chunks of up to 32 tokens (eager launches, once)."""
        n = len(self.prefix_ids)
        if n == 0:
            return
        slots = np.asarray(self.kv.prefix_slots, dtype=np.int32)
        for p0 in range(0, n, T_CHUNK):
            T = min(T_CHUNK, n - p0)
            self._set_inputs(self.weights.prefix_embed[p0:p0 + T], slots[:p0 + T], p0 + T, p0, T, 0)
            self.enqueue_prefill()
        self.stream.synchronize()

    def _ensure_capacity(self) -> None:
        if self.kv.budget_tokens <= self.kvc.capacity:
            return
        self.log(f"cuda engine: KV budget grew to {self.kv.budget_tokens} tokens: reallocating the cache and "
                 "re-capturing the graphs")
        sizes = memory_plan(self.cfg, self.kv.budget_tokens, self.scratch_slots)
        check_budget(self._model_bytes(sizes), sizes["kv"], sizes["scratch"], self.max_vram_gb)
        self.stream.synchronize()
        self.kvc.allocate(self.kv.budget_tokens)
        self._capture()

    def _apply_moves(self) -> None:
        take = getattr(self.kv, "take_moves", None)
        moves = take() if take else []
        if not moves:
            return
        src, dst, n = self.kvc.upload_moves(moves)
        L, nkv = self.cfg.num_hidden_layers, self.kvc.nkv
        move = Launch("kv_move", (min(4096, -(-L * n * nkv // BLOCK)), 1), (BLOCK, 1, 1))
        self.launcher(move, self.kvc.kc, self.kvc.vc, L, self.kvc.slots, nkv, src, dst, n, serial=True)

    # ---- engine API --------------------------------------------------------------------------------------
    @property
    def tokens_per_frame(self) -> int:
        return self.kv.tokens_per_frame

    def encode_frame(self, image: np.ndarray) -> np.ndarray:
        """Patchify on the host, patch projection (+bias+pos) as a tensor-core GEMM on the GPU."""
        w, a, cfg = self.weights, self.act, self.cfg
        patches = w.vision.patches(image)
        n = patches.shape[0]
        buf = np.zeros((T_CHUNK, cfg.patch_dim), np.uint16)
        buf[:n] = f32_to_bf16_bits(patches)
        out = np.empty((T_CHUNK, cfg.hidden_size), np.float32)
        cuda = self._cuda
        with self._active():
            cuda.memcpy_htod_async(a.vis_in, buf, self.stream)
            cuda.memcpy_dtod_async(a.vis_out, w.vis_bias_pos, 4 * T_CHUNK * cfg.hidden_size, self.stream)
            forward._gemm(self.launcher, self.plan.vision, a.vis_in, cfg.patch_dim, w.w_patch, cfg.hidden_size,
                          cfg.patch_dim, a.vis_out, cfg.hidden_size, serial=True)
            cuda.memcpy_dtoh_async(out, a.vis_out, self.stream)
            self.stream.synchronize()
        return out[:n]

    def chunk_support_problem(self) -> str | None:
        """Autoregressive chunks of any H are decoded, parallel ones of up to PARALLEL_MAX_TILES x T_CHUNK action
        slots (one prefill-shaped pass in row tiles); more are refused by name (pass_meta.parallel_slots_problem)."""
        problem = parallel_slots_problem(self.cfg)
        return None if problem is None else f"the {self.name} backend refuses {problem}"

    def run_chunk(self, vision_tokens: np.ndarray, frame_id: int, salient: bool = False,
                  forced_bins: np.ndarray | None = None) -> ChunkResult:
        t0 = time.perf_counter()
        forced_rows = check_forced_bins(self.cfg, forced_bins)  # ValueError before the cache is touched
        forced = None if forced_rows is None else forced_gen(self.cfg, forced_rows, self.scratch_slots + 1)
        x = check_vision_tokens(vision_tokens, self.kv.tokens_per_frame, self.cfg.hidden_size)
        cuda = self._cuda
        try:
            adm, gen, prefill_ms, decode_ms = self._device_chunk(x, frame_id, salient, forced)
        except cuda.Error as e:
            # A device error (out of memory, launch failure) can leave the cache half-written and the frame
            # admitted: the inference loop resets the engine before the next chunk instead of a node restart.
            self.needs_reset = True
            raise EngineError(f"CUDA error during chunk {frame_id}: {e}") from e
        self.last_logits = self.act.h_logits.copy()
        bins = chunk_bins(self.cfg, gen)  # (H, action_dims)
        if np.any(bins < 0) or np.any(bins >= self.cfg.n_action_bins):
            raise EngineError(f"decode produced token ids outside the action rows: {gen.tolist()}")
        chunk = readout_actions(self.cfg, self.tokenizer, bins, self.last_logits, self.action_readout,
                                0 if forced_rows is None else len(forced_rows))
        return ChunkResult(frame_id=int(frame_id), token_ids=gen, action_bins=bins[0].copy(), action=chunk[0].copy(),
                           prefill_ms=float(prefill_ms), decode_ms=float(decode_ms),
                           total_ms=(time.perf_counter() - t0) * 1e3, evicted_frames=list(adm.evicted),
                           kv_occupancy_tokens=int(self.kv.occupancy_tokens), salient=bool(salient),
                           chunk=chunk, chunk_bins=bins, forced_steps=0 if forced_rows is None else len(forced_rows))

    def _device_chunk(self, x: np.ndarray, frame_id: int, salient: bool, forced: np.ndarray | None):
        from vla_edge_ros.engine.vision import pooled
        cuda, a, tpf = self._cuda, self.act, self.kv.tokens_per_frame
        t = [time.perf_counter()]
        with self._active():
            self._apply_moves()
            adm = self.kv.admit(frame_id, pooled(x), salient)
            self._ensure_capacity()
            ctx = np.asarray(self.kv.context_slots(), dtype=np.int32)
            n_ctx = len(ctx)
            # the scratch slots after the context: the decode steps', or the parallel pass's A slots (its keys)
            slots = np.concatenate([ctx, self.kvc.capacity + np.arange(self.scratch_slots, dtype=np.int32)])
            t.append(time.perf_counter())
            self._set_inputs(x, slots, n_ctx, n_ctx - tpf, tpf, n_ctx, forced, parallel=self.parallel)
            t.append(time.perf_counter())
            first, *rest = self._passes()
            self.ev[0].record(self.stream)
            self._run(*first)  # prefill_ms: the frame's prefill (or the fused pass: the whole chunk)
            self.ev[1].record(self.stream)
            for graph in rest:
                self._run(*graph)  # decode_ms: the decode steps, or the parallel pass
            self.ev[2].record(self.stream)
            t.append(time.perf_counter())
            cuda.memcpy_dtoh_async(a.h_tok, a.tok_buf, self.stream)
            cuda.memcpy_dtoh_async(a.h_logits, a.logits, self.stream)
            self.ev[3].record(self.stream)
            self.ev[3].synchronize()
            t.append(time.perf_counter())
            self.host_profile_ms = {k: 1e3 * (b - e) for k, e, b in
                                    zip(("admit", "inputs", "launch", "wait"), t[:-1], t[1:])}
            prefill_ms = self.ev[1].time_since(self.ev[0])
            decode_ms = self.ev[2].time_since(self.ev[1])
        return adm, a.h_tok.astype(np.int64), prefill_ms, decode_ms

    # ---- read-back for tests and benchmarks --------------------------------------------------------------
    def read_final_hidden(self) -> tuple[np.ndarray, np.ndarray]:
        """(prefill rows (32, H), decode steps (decode_steps, H)) of the final-normed hidden state. With parallel
        decoding the 32 rows are the parallel pass's first tile: its first 32 slots (after the frame's rows when
        fused)."""
        H = self.cfg.hidden_size
        with self._active():
            self.stream.synchronize()
            a = np.empty((T_CHUNK, H), np.float32)
            b = np.empty((self.decode_steps, H), np.float32)
            self._cuda.memcpy_dtoh(a, self.act.final_h + (4 * T_CHUNK * H if self.fused else 0))
            self._cuda.memcpy_dtoh(b, self.act.final_h_dec)
        return a, b

    def reset(self) -> None:
        """Drop every retained frame; the pinned prefix (its K/V and slots) stays."""
        self.needs_reset = False
        if hasattr(self.kv, "reset"):
            self.kv.reset()
        else:
            kv = self.kv
            self.kv = type(kv)(kv.budget_tokens, kv.tokens_per_frame, kv.prefix_tokens, policy=kv.policy,
                               window_frames=kv.window_frames, semantic_evict=kv.semantic_evict)

    def memory(self) -> dict[str, int]:
        s = self.mem.tracker.stats()
        return {"current_bytes": s["current_bytes"], "peak_bytes": s["peak_bytes"]}
