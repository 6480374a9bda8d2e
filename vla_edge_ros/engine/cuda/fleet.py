"""FleetCudaEngine: one GPU serving N robots (issue 24): the chunks due in one cycle run as ONE batched pass that
reads every weight once for all of them; the contract of core/fleet_contract.FleetEngine, as engine/fleet_numpy.py
(the oracle: a batch equals the robots run one by one).

Why a pass of its own rather than the single engine's graphs per robot: a chunk is bound by the bytes of weights it
reads (docs/GPU.md), so N robots one after the other cost N times one; stacked, a pass reads the weights once and
only the K/V and the arithmetic grow with N. The layout:

* rows: a pass's rows are its members' rows stacked: the frame prefill tokens_per_frame rows per member (member m at
  rows m * tpf ..), a decode step one row per member (row m); the GEMMs run over ceil(rows / 32) tiles of 32
  (gemm32t_atomic: weights in registers once, every tile in turn; cuda/fleet.cu), the row-wise kernels over the
  tiles' rows;
* each robot owns a region of one shared KV cache (``region`` = its budget + the S scratch slots of the decode
  steps), so its slot list is its KVManager's slots + the region's first slot; the attention and its merge take
  every member in one launch (grid.z / grid.y = member), each with its own record [L keys, p0, T rows, n_ctx, 0,
  base row, 0, 0] per pass (``_records``: the prefill's, then every decode step's: all written in one copy before
  the replays), its own slot list and split partials (cuda/rope_attention.cu, the *_batch kernels);
* a decode step is a pass of one row per member (keys = its context + the steps so far): its linear maps on
  gemv_rows_mma (the weights the m16 side of the tensor cores, the robots the n8 side; tuning fleet_gemv "rows": the
  CUDA-core gemv_rows_atomic), the step's own K/V stored by kv_store_rows, then attn_decode_batch; each step's first
  launch is serial (the attention stages older keys before its PDL wait, and the step before wrote one of them);
* the head: each member's last row gathered (rows_gather), gemv_logits over the members (grid.y), argmax_tokens
  (grid.x) into tok[step][member]; the next step's embed_gather reads them (grid.y = members): the greedy chain
  stays on the device.

Graphs: two per batch size n (the prefill pass, the decode steps), captured on first use (the fleet loop's warm-up
runs every size) over fixed buffers sized for ``max_robots``. Per chunk the host writes the frames' rows, the slot
lists and the records (three async copies), replays both graphs and reads back tokens and logits.

Not built (refused by name at construction): quantised weights (the multi-tile GEMM has a bf16 form only), parallel
chunk decoding, models whose query heads per KV head need the head-group attention kernels, frames of more than 32
tokens; KV budgets above the region size given at construction (a robot's budget cannot grow live).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Union

import numpy as np

from vla_edge_ros.core.action_tokenizer import ActionTokenizer
from vla_edge_ros.engine.config import ModelConfig
from vla_edge_ros.engine.cuda import fleet_forward
from vla_edge_ros.engine.cuda.device import DeviceEngine
from vla_edge_ros.engine.geometry import (check_action_readout, check_chunk_geometry, check_decode_tokens, chunk_bins,
                                          chunk_decode_steps, is_parallel, readout_actions)
from vla_edge_ros.engine.cuda.fleet_forward import REC  # ints per member record
from vla_edge_ros.engine.fleet_numpy import UnknownRobotError
from vla_edge_ros.engine.interface import ChunkResult, EngineError, check_vision_tokens


def fleet_unsupported_reason(cfg: ModelConfig, weight_dtype: str, tokens_per_frame: int) -> Optional[str]:
    """Why the batched CUDA pass refuses this model (None: it does not). Pure: tested without a GPU."""
    from vla_edge_ros.engine.cuda.plan import HEAD_DIMS, LaunchConstants, T_CHUNK
    c = LaunchConstants()
    if weight_dtype != "bf16":
        return (f"weight_dtype={weight_dtype!r}: the batched CUDA pass has bf16 weights only (its multi-tile GEMM "
                "has no quantised form yet); use weight_dtype bf16 or backend numpy for a quantised fleet")
    if is_parallel(cfg):
        return "vla.chunk_decode='parallel': the batched CUDA pass decodes autoregressively only; use backend numpy"
    if cfg.head_dim not in HEAD_DIMS:
        return f"head_dim={cfg.head_dim}: the attention kernels are built for {HEAD_DIMS}"
    maxg = c.PF_MAXG_128 if cfg.head_dim == 128 else c.PF_MAXG_64
    if cfg.n_groups > maxg:
        return (f"{cfg.n_groups} query heads per KV head: the batched attention takes at most {maxg} at head_dim "
                f"{cfg.head_dim} (no head groups); use backend numpy")
    if tokens_per_frame > T_CHUNK:
        return f"tokens_per_frame={tokens_per_frame}: at most {T_CHUNK}"
    return None


@dataclass
class FleetRobot:
    """One robot's share of the engine: its KVManager and its region of the shared cache."""
    name: str
    kv: Any
    region: int
    prefix_tokens: int
    last_logits: Optional[np.ndarray] = None
    chunks: int = 0
    errors: int = 0


@dataclass
class _Member:
    name: str
    robot: FleetRobot
    req: Any
    x: np.ndarray
    adm: Any = None
    n_ctx: int = 0
    slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))


class FleetCudaEngine(DeviceEngine):
    """N robots on one GPU, batched passes (module docstring). Not thread-safe: one thread owns it."""

    name = "cuda"

    def __init__(self, cfg: ModelConfig, checkpoint, kv_factory: Callable[..., Any], instruction: str = "",
                 decode_tokens: int = 8, max_robots: int = 8, budget_tokens: int = 4096, max_vram_gb: float = 80.0,
                 log: Callable[[str], None] = print, use_graphs: bool = True, tuning=None,
                 weight_dtype: str = "bf16", action_readout: str = "argmax"):
        from vla_edge_ros.engine.cuda.plan import Tuning
        from vla_edge_ros.engine.cuda.probe import cuda_status
        from vla_edge_ros.engine.geometry import prefix_token_ids
        check_decode_tokens(cfg, int(decode_tokens))
        problem = fleet_unsupported_reason(cfg, weight_dtype, cfg.n_patches)
        if problem:
            raise EngineError(f"the batched CUDA pass refuses the model: {problem}")
        if max_robots < 1:
            raise EngineError(f"max_robots must be >= 1, got {max_robots}")
        ok, why = cuda_status()
        if not ok:
            raise EngineError(f"CUDA backend unavailable: {why}")
        import pycuda.driver as cuda
        self._cuda, self.cfg, self.log, self.instruction = cuda, cfg, log, instruction
        self.weight_dtype, self.use_graphs = weight_dtype, bool(use_graphs)
        self.action_readout = check_action_readout(action_readout)  # host-side, per member (geometry.py)
        self.tuning = tuning if isinstance(tuning, Tuning) else Tuning.from_mapping(tuning)
        self.decode_tokens = int(decode_tokens)
        self.decode_steps = chunk_decode_steps(cfg, self.decode_tokens)  # S
        self.max_robots, self.budget_tokens = int(max_robots), int(budget_tokens)
        self.tpf = cfg.n_patches
        self.tokenizer = ActionTokenizer(cfg.vocab_size, cfg.action_q01, cfg.action_q99, cfg.n_action_bins)
        self.prefix_ids = np.asarray(prefix_token_ids(instruction), np.int64)
        self._kv_factory = kv_factory
        self.robots: dict[str, FleetRobot] = {}
        self.cache_resets: dict[str, int] = {}
        self.last_batch_timing: dict[str, float] = {"prefill_ms": 0.0, "decode_ms": 0.0}
        self.last_batch_size = 0
        self._host_split: dict[str, float] = {}
        self.needs_reset = False
        self.max_vram_gb = float(max_vram_gb)
        self._open_device(cfg, lambda: self._setup(checkpoint))  # device.DeviceEngine

    # ---- set-up ------------------------------------------------------------------------------------------
    def _setup(self, checkpoint) -> None:
        from vla_edge_ros.engine.cuda.buffers import DeviceMemory, Weights
        from vla_edge_ros.engine.cuda.kernels import Launcher
        from vla_edge_ros.engine.cuda.plan import for_weight_dtype, plan
        cuda, cfg = self._cuda, self.cfg
        t0 = time.perf_counter()
        need = self.planned_bytes()
        if need > self.max_vram_gb * 2**30:
            raise EngineError(f"the fleet needs {need / 2**30:.2f} GiB of device memory for {self.max_robots} robots "
                              f"x {self.budget_tokens} KV tokens, max_vram_gb={self.max_vram_gb}: fewer robots, a "
                              "smaller kv_budget_tokens or a larger max_vram_gb")
        self.mem = DeviceMemory(cuda, int(self.max_vram_gb * 2**30))
        w = self._load_weights(checkpoint)  # bf16 (fleet_unsupported_reason): tensors by name as bf16 bits
        self._compile()
        p = for_weight_dtype(plan(cfg, self.tuning, self.limits), "bf16", cfg, self.limits.constants)
        for launch in (p.attn_prefill, p.attn_decode):
            if launch.kernel.endswith("_hg"):
                raise EngineError(f"the batched CUDA pass refuses the model: its attention needs head groups on this "
                                  f"device ({launch.kernel}); use backend numpy")
        self._apply_plan(p)
        c = self.limits.constants
        self.kernels.raise_dynamic_smem("gemv_rows_atomic", 4 * c.GR_MAXM * fleet_forward.GR_MAX_KS)
        for mode in ("atomic", "silu"):  # the tiled prefill GEMMs (tuning fleet_gemm = "tiled")
            self.kernels.raise_dynamic_smem(f"gemm_tiled128_{mode}", c.GT_SMEM128)
            self.kernels.raise_dynamic_smem(f"gemm_tiled64_{mode}", c.GT_SMEM64)
        t1 = time.perf_counter()
        self.weights = Weights(self.mem, cfg, w, self.prefix_ids)
        self.weight_bytes = int(self.mem.tracker.current_bytes)
        del w
        self._allocate()
        self.stream = cuda.Stream()
        self.ev = [cuda.Event() for _ in range(3)]
        self.launcher = Launcher(self.kernels, self.stream, self.plan.pdl)
        self.stream.synchronize()
        self.log(f"cuda fleet engine: {self.device_name}, up to {self.max_robots} robots x {self.budget_tokens} KV "
                 f"tokens, device memory {self.mem.tracker.current_bytes / 2**30:.3f} GiB, set-up "
                 f"{time.perf_counter() - t0:.1f} s (compile {t1 - t0:.1f} s), PDL {'on' if self.plan.pdl else 'off'}")

    def planned_bytes(self) -> int:
        """Weights (bf16) + every robot's KV region + the pass's buffers, before any allocation."""
        from vla_edge_ros.engine.cuda.vram import memory_plan
        sizes = memory_plan(self.cfg, self.budget_tokens, self.decode_steps)
        kv = self.max_robots * sizes["kv"]
        return int(sizes["model"] + kv + self.max_robots * sizes["scratch"] + self._row_bytes())

    def _row_bytes(self) -> int:
        cfg = self.cfg
        H, I = cfg.hidden_size, cfg.intermediate_size
        nqkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
        return 4 * (self._rows_max() + 32) * (2 * H + nqkv + 2 * I)

    def _rows_max(self) -> int:
        return 32 * math.ceil(self.max_robots * self.tpf / 32)

    def _allocate(self) -> None:
        from vla_edge_ros.engine.cuda.plan import padded_intermediate
        cuda, cfg, mem = self._cuda, self.cfg, self.mem
        H, I, HD, L = cfg.hidden_size, padded_intermediate(cfg), cfg.head_dim, cfg.num_hidden_layers
        Hq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads * HD
        nq, nqkv, n_bins = Hq * HD, Hq * HD + 2 * nkv, cfg.n_action_bins
        S, R, M = self.decode_steps, self._rows_max(), self.max_robots
        self.region = self.budget_tokens + S
        self.slots_total = M * self.region
        self.nkv, self.kps = nkv, self.plan.keys_per_split
        kv_bytes = 2 * L * self.slots_total * nkv
        self.kc, self.vc = mem.alloc("kc", kv_bytes), mem.alloc("vc", kv_bytes)
        cuda.memset_d16(self.kc, 0, kv_bytes // 2)
        cuda.memset_d16(self.vc, 0, kv_bytes // 2)
        inv = 1.0 / (float(cfg.rope_theta) ** (np.arange(0, HD, 2, dtype=np.float64) / HD))
        ang = np.arange(self.region + 64, dtype=np.float64)[:, None] * inv[None, :]
        cs = np.empty((self.region + 64, HD // 2, 2), np.float32)
        cs[..., 0], cs[..., 1] = np.cos(ang), np.sin(ang)
        self.rope = mem.alloc("rope", cs.nbytes, cs)
        self.nsplit = -(-self.region // self.kps)
        self.part_rows = self.nsplit * Hq * 32
        self.part_o = mem.alloc("part_o", 4 * M * self.part_rows * HD)
        self.part_ml = mem.alloc("part_ml", 8 * M * self.part_rows)
        self.x = mem.zeros("x", (R + 32, H), np.float32)
        self.h_bf = mem.zeros("h_bf", (R + 32, H), np.uint16)
        self.qkv = mem.zeros("qkv", (R + 32, nqkv), np.float32)
        self.attn_bf = mem.zeros("attn_bf", (R + 32, nq), np.uint16)
        self.gu = mem.zeros("gu", (R + 32, 2 * I), np.float32)
        self.act_bf = mem.zeros("act_bf", (R + 32, I), np.uint16)
        self.xg = mem.zeros("xg", (M, H), np.float32)
        self.logits = mem.zeros("logits", ((S + 1) * M, n_bins), np.float32)
        self.tok = mem.zeros("tok", (S + 1) * M, np.int32)
        self.forced = mem.alloc("forced", 4 * (S + 1) * M, np.full((S + 1) * M, -1, np.int32))
        self.one = mem.alloc("one", 4, np.ones(1, np.int32))  # gemv_logits' row index + 1 (its row = 0 + y)
        self.meta = mem.zeros("meta", ((S + 1) * M, REC), np.int32)
        self.key_slots = mem.zeros("key_slots", (M, self.region), np.int32)
        self.h_x = cuda.pagelocked_zeros((R, H), np.float32)
        self.h_meta = cuda.pagelocked_zeros(((S + 1) * M, REC), np.int32)
        self.h_slots = cuda.pagelocked_zeros((M, self.region), np.int32)
        self.h_tok = cuda.pagelocked_zeros((S + 1) * M, np.int32)
        self.h_logits = cuda.pagelocked_zeros(((S + 1) * M, n_bins), np.float32)
        self._free_regions = list(range(M))
        self.kv_bytes_per_robot = 2 * 2 * L * self.region * nkv

    # ---- the batched pass (engine/cuda/fleet_forward.py) ----------------------------------------------------
    def _zero(self, ptr: int, count: int) -> None:
        self._cuda.memset_d32_async(ptr, 0, count, self.stream)

    def enqueue_prefill(self, n: int, k=None) -> None:
        fleet_forward.prefill(self, k or self.launcher, self._zero, n)

    def enqueue_decode(self, n: int, k=None) -> None:
        fleet_forward.decode(self, k or self.launcher, self._zero, n)

    def _graph(self, kind: str, n: int):
        from vla_edge_ros.engine.cuda.graphs import CudaGraph
        g = self._graphs.get((kind, n))
        if g is None:
            enqueue = self.enqueue_prefill if kind == "prefill" else self.enqueue_decode
            self.stream.synchronize()
            g = CudaGraph(f"fleet_{kind}_{n}").capture(self.stream, lambda: enqueue(n))
            self._graphs[(kind, n)] = g
        return g

    def _run(self, kind: str, n: int) -> None:
        if self.use_graphs:
            self._graph(kind, n).launch(self.stream)
        else:
            (self.enqueue_prefill if kind == "prefill" else self.enqueue_decode)(n)

    # ---- membership -----------------------------------------------------------------------------------------
    def add_robot(self, name: str) -> None:
        """Give ``name`` a KV region (its KVManager from kv_factory) with the instruction prefix prefilled."""
        if name in self.robots:
            raise ValueError(f"robot {name!r} is already served by this engine")
        if not self._free_regions:
            raise EngineError(f"robot {name!r}: the engine serves at most {self.max_robots} robots (max_robots)")
        kv = self._kv_factory(name)  # the fleet node's factory takes the robot's name (each may differ)
        if kv.budget_tokens > self.budget_tokens or kv.tokens_per_frame != self.tpf:
            raise EngineError(f"robot {name!r}: KV budget {kv.budget_tokens} / {kv.tokens_per_frame} tokens per "
                              f"frame; this engine's regions hold {self.budget_tokens} / {self.tpf}")
        check_chunk_geometry(self.cfg, kv, self.instruction, self.decode_tokens)
        robot = FleetRobot(name, kv, self._free_regions.pop(0), len(self.prefix_ids))
        try:
            self._prefill_prefix(robot)
        except Exception:
            self._free_regions.insert(0, robot.region)
            raise
        self.robots[name] = robot

    def remove_robot(self, name: str) -> None:
        robot = self.robots.pop(name, None)
        if robot is None:
            raise UnknownRobotError(f"robot {name!r} is not served by this engine")
        self._free_regions.append(robot.region)
        self._free_regions.sort()

    def _prefill_prefix(self, robot: FleetRobot) -> None:
        """The pinned prefix into the robot's region: eager passes of up to 32 rows as member 0."""
        n = len(self.prefix_ids)
        if n == 0:
            return
        cuda = self._cuda
        slots = np.asarray(robot.kv.prefix_slots, np.int32) + robot.region * self.region
        with self._active():
            for p0 in range(0, n, 32):
                T = min(32, n - p0)
                self.h_x[:32] = 0.0
                self.h_x[:T] = self.weights.prefix_embed[p0:p0 + T]
                self.h_meta[0] = [p0 + T, p0, T, 0, 0, 0, 0, 0]
                self.h_slots[0, :p0 + T] = slots[:p0 + T]
                cuda.memcpy_htod_async(self.x, self.h_x[:32], self.stream)
                cuda.memcpy_htod_async(self.meta, self.h_meta[:1], self.stream)
                cuda.memcpy_htod_async(self.key_slots, self.h_slots[:1], self.stream)
                fleet_forward.batched_pass(self, self.launcher, self._zero, 1, T, self.meta, self.key_slots,
                                           fleet_forward.logits_ptr(self, 0), 0)
            self.stream.synchronize()

    # ---- the rest of the contract ------------------------------------------------------------------------
    @property
    def action_names(self) -> tuple[str, ...]:
        return tuple(self.cfg.action_names)

    @property
    def tokens_per_frame(self) -> int:
        return int(self.tpf)

    def robot(self, name: str) -> FleetRobot:
        try:
            return self.robots[name]
        except KeyError:
            raise UnknownRobotError(f"robot {name!r} is not served by this engine") from None

    def encode_frame(self, image: np.ndarray) -> np.ndarray:
        """Patchify and project on the host (the numpy patch embedder of the same weights): ~2 ms of the loop
        thread per frame on the H200's host, off the batched pass. Measured against the single engine's device
        GEMM (session 21, 8-robot replay): the host part's p99 rose 38 -> 62 ms, since every CUDA call hands the
        GIL over and the edge's ten other Python threads make each hand-back wait (docs/KERNEL_NOTES_MANY_ROWS.md,
        session 21)."""
        return self.weights.vision(image)

    def reset(self) -> None:
        for robot in self.robots.values():
            robot.kv.reset()
        self.needs_reset = False

    def memory(self) -> dict:
        s = self.mem.tracker.stats()
        per = {name: int(self.kv_bytes_per_robot) for name in self.robots}
        return {"current_bytes": s["current_bytes"], "peak_bytes": s["peak_bytes"], "weight_bytes": self.weight_bytes,
                "kv_bytes": int(self.kv_bytes_per_robot) * self.max_robots, "per_robot_kv_bytes": per,
                "kv_bytes_per_robot": int(self.kv_bytes_per_robot)}

    # ---- one batched chunk ---------------------------------------------------------------------------------
    def run_batch(self, requests: Mapping[str, Any]) -> dict[str, Union[ChunkResult, Exception]]:
        t0 = time.perf_counter()
        results: dict[str, Union[ChunkResult, Exception]] = {}
        members = [m for m in (self._admit(name, req, results) for name, req in requests.items()) if m is not None]
        prefill_ms = decode_ms = 0.0
        if members:
            try:
                gen, logits, prefill_ms, decode_ms = self._device_batch(members)
            except Exception as exc:
                for m in members:
                    self._reset_robot(m.robot)
                if isinstance(exc, self._cuda.Error):
                    self.needs_reset = True
                    raise EngineError(f"CUDA error during a batch of {len(members)}: {exc}") from exc
                raise
            for j, m in enumerate(members):
                results[m.name] = self._result(m, gen[:, j], logits[:, j], prefill_ms, decode_ms, t0)
        self.last_batch_timing = {"prefill_ms": float(prefill_ms), "decode_ms": float(decode_ms),
                                  **(self._host_split if members else {})}
        self.last_batch_size = len(members)
        return {name: results[name] for name in requests}

    def _admit(self, name: str, req: Any, results: dict) -> Optional[_Member]:
        from vla_edge_ros.engine.vision import pooled
        robot = self.robots.get(name)
        if robot is None:
            results[name] = UnknownRobotError(f"robot {name!r} was not added to this engine (add_robot first)")
            return None
        try:
            x = check_vision_tokens(req.vision_tokens, self.tpf, self.cfg.hidden_size)
        except Exception as exc:
            results[name] = exc
            return None
        m = _Member(name, robot, req, x)
        try:
            if robot.kv.budget_tokens > self.budget_tokens:
                raise EngineError(f"robot {name!r}: KV budget {robot.kv.budget_tokens} > the region's "
                                  f"{self.budget_tokens} tokens")
            m.adm = robot.kv.admit(req.frame_id, pooled(x), bool(req.salient))
            self._apply_moves(robot)
            ctx = np.asarray(robot.kv.context_slots(), np.int32)
            m.n_ctx = len(ctx)
            base = robot.region * self.region
            m.slots = np.concatenate([ctx, self.budget_tokens + np.arange(self.decode_steps, dtype=np.int32)]) + base
        except Exception as exc:
            self._reset_robot(robot)
            results[name] = exc
            return None
        return m

    def _apply_moves(self, robot: FleetRobot) -> None:
        """A budget shrink's K/V relocations within the robot's region (kv_move, eagerly)."""
        from vla_edge_ros.engine.cuda.plan import BLOCK, Launch
        take = getattr(robot.kv, "take_moves", None)
        moves = take() if take else []
        if not moves:
            return
        base = robot.region * self.region
        src = np.concatenate([np.asarray(mv[1], np.int32) for mv in moves]) + base
        dst = np.concatenate([np.asarray(mv[2], np.int32) for mv in moves]) + base
        n = len(src)
        with self._active():
            buf = self._cuda.to_device(np.concatenate([src, dst]))
            L = self.cfg.num_hidden_layers
            move = Launch("kv_move", (min(4096, -(-L * n * self.nkv // BLOCK)), 1), (BLOCK, 1, 1))
            self.launcher(move, self.kc, self.vc, L, self.slots_total, self.nkv, int(buf), int(buf) + 4 * n, n,
                          serial=True)
            self.stream.synchronize()
            buf.free()

    def _reset_robot(self, robot: FleetRobot) -> None:
        self.cache_resets[robot.name] = self.cache_resets.get(robot.name, 0) + 1
        try:
            robot.kv.reset()
        except Exception:
            self.needs_reset = True

    def _device_batch(self, members: list[_Member]):
        cuda, M, S, tpf = self._cuda, self.max_robots, self.decode_steps, self.tpf
        t0 = time.perf_counter()
        n = len(members)
        rows = n * tpf
        R = 32 * math.ceil(rows / 32)
        self.h_x[:R] = 0.0
        for j, m in enumerate(members):
            self.h_x[j * tpf:(j + 1) * tpf] = m.x
            self.h_slots[j, :len(m.slots)] = m.slots
            self.h_meta[j] = [m.n_ctx, m.n_ctx - tpf, tpf, m.n_ctx, 0, j * tpf, 0, 0]
            for s in range(1, S + 1):
                self.h_meta[s * M + j] = [m.n_ctx + s, m.n_ctx + s - 1, 1, m.n_ctx, 0, j, 0, 0]
        with self._active():
            cuda.memcpy_htod_async(self.x, self.h_x[:R], self.stream)
            cuda.memcpy_htod_async(self.key_slots, self.h_slots[:n], self.stream)
            cuda.memcpy_htod_async(self.meta, self.h_meta, self.stream)
            self.ev[0].record(self.stream)
            self._run("prefill", n)
            self.ev[1].record(self.stream)
            self._run("decode", n)
            self.ev[2].record(self.stream)
            cuda.memcpy_dtoh_async(self.h_tok, self.tok, self.stream)
            cuda.memcpy_dtoh_async(self.h_logits, self.logits, self.stream)
            t1 = time.perf_counter()
            self.stream.synchronize()
            # the host's split of the call (core/pass_profile.py): staging + launches, then the wait for the device
            self._host_split = {"launch_ms": (t1 - t0) * 1e3, "sync_ms": (time.perf_counter() - t1) * 1e3}
            prefill_ms, decode_ms = self.ev[1].time_since(self.ev[0]), self.ev[2].time_since(self.ev[1])
        gen = self.h_tok.reshape(S + 1, M)[:, :n].astype(np.int64)
        logits = self.h_logits.reshape(S + 1, M, -1)[:, :n].copy()
        return gen, logits, prefill_ms, decode_ms

    def _result(self, m: _Member, gen: np.ndarray, logits: np.ndarray, prefill_ms: float, decode_ms: float,
                t0: float) -> Union[ChunkResult, Exception]:
        cfg = self.cfg
        m.robot.last_logits = logits
        bins = chunk_bins(cfg, gen)
        if np.any(bins < 0) or np.any(bins >= cfg.n_action_bins):
            m.robot.errors += 1
            return EngineError(f"robot {m.name!r}: decode produced token ids outside the action rows: {gen.tolist()}")
        chunk = readout_actions(cfg, self.tokenizer, bins, logits, self.action_readout)
        m.robot.chunks += 1
        return ChunkResult(frame_id=int(m.req.frame_id), token_ids=gen.copy(), action_bins=bins[0].copy(),
                           action=chunk[0].copy(), prefill_ms=float(prefill_ms), decode_ms=float(decode_ms),
                           total_ms=(time.perf_counter() - t0) * 1e3, evicted_frames=list(m.adm.evicted),
                           kv_occupancy_tokens=int(m.robot.kv.occupancy_tokens), salient=bool(m.req.salient),
                           chunk=chunk, chunk_bins=bins, forced_steps=0)
