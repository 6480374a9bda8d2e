"""Calibrated quantisation (GPTQ, Frantar et al. 2022): the same codes, chosen for the layer's output, not each weight.

Why: round-to-nearest (engine/quant.py) makes every weight's own error as small as it can be, but what the robot
sees is the layer's OUTPUT, x @ W'.T, on the inputs the policy actually gets. On the shipped policy, round-to-nearest
fp8 and int4 missed issue 23's cosine bars (0.9957 and 0.9655 worst over 100 push frames, against 0.999 and 0.99).
GPTQ quantises one input column at a time and moves the error it just made onto the columns not yet quantised, in
the proportions that cancel it on the calibration inputs: it minimises ||X (W - W').T||^2 for the inputs X the layer
saw, through H = X.T X. Measured on the shipped policy (docs/QUANTIZATION.md has the table): the worst cosine of
fp8 rises from 0.9957 to 0.9991 and int4's from 0.9655 to 0.9912, both over their bars.

The output is the same QuantizedLinear container in the same layouts (the codes, per-row / per-group float32
scales and int4 zero points of engine/quant.py), so nothing downstream changes: the pre-quantised checkpoint
(engine/quant_checkpoint.py), both backends, the kernels and the VRAM count take it as they are. Only which code
each weight gets differs. The scales follow the same formulas (int8 / fp8 from the original row's largest weight;
int4 from each group's range when the sweep reaches it, optionally shrunk by the clip search below), and the codes
are computed in float32 exactly as the round-to-nearest quantiser computes them, so a GPTQ weight with no error
to carry (a diagonal H) gets exactly the round-to-nearest codes (tested).

Algorithm (the paper's, with its lazy block updates):
    H = sum over calibration rows of x x.T (in, in), + damp * mean(diag H) * I (damping makes it invertible when
    the calibration inputs do not span every direction); U = upper Cholesky factor of H^-1.
    for each input column i in order: q_i = quantise(w_i); e = (w_i - q_i) / U[i, i];
        w_j -= e * U[i, j] for every later column j (within a block at once, then one GEMM for the rest)
A column no calibration input ever reached (diag H = 0) is quantised by rounding, and carries no error onward.
int4 group parameters come from the group's current (already corrected) weights when the sweep enters the group;
the clip search tries shrinking the group's range by each factor of ``int4_clip_grid`` and keeps, per row, the one
with the least diag(H)-weighted error (as AWQ / llama.cpp do, measured here to help by a few percent; it is cheap).

Calibration (``CalibrationStreams``, ``calibrate``): the reference forward (engine/reference.py) streams each
calibration sequence the way an engine does (the KV window of the training run, the instruction prefix, every
decode step; the instruction prefix, computed once per episode, is not recorded), and a recording weights mapping
(``HessianRecorder``) adds x.T x for the inputs of the linear layers being quantised. Weights are quantised in order, in four stages per decoder layer (q/k/v,
o, gate/up, down: ``STAGES``), and each stage's inputs are recorded with everything before it already quantised
("true sequential"), so each weight corrects for the error of those before it: four calibration passes per decoder
layer. Measured on the shipped policy, against one pass per layer (all seven weights recorded with the earlier
LAYERS quantised): worst cosine int4 0.9893 -> 0.9914, fp8 0.99869 -> 0.99924, for 4x the calibration time. The vision front end is not quantised, so its tokens are computed once. Too few rows for a
weight's inputs and GPTQ fits them rather than the distribution: measured on a 2-layer model, 240 rows of noise
frames for 192 inputs made int4 worse than rounding on other frames, 800 rows of camera-like frames 4x better.
``calibrate`` says so in its progress lines (``FEW_ROWS_PER_INPUT``).

Choose calibration frames from the robot's own distribution, and never the frames that judge the result:
train/quantize.py takes demonstration bags; bench/quant_report.py --calibrate-tasks uses sim expert frames from
seeds disjoint from the ones it evaluates on.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional, Sequence

import numpy as np

from vla_edge_ros.core.kv.manager import KVManager
from vla_edge_ros.engine import reference as R
from vla_edge_ros.engine.config import ModelConfig
from vla_edge_ros.engine.quant import (GROUP_SIZE, WEIGHT_DTYPES, QuantizedLinear, QuantizedModel, _finite_matrix,
                                       _safe, e4m3_decode, e4m3_encode, int4_codes, int4_scale_zero, int8_codes,
                                       is_quantized_name, pack_int4, quant_stats, quantize_bf16, row_scales)

DAMP = 0.01  # the paper's default: 1 % of the mean diagonal
BLOCK = 128  # columns updated at once before the GEMM that carries their errors to the rest; a multiple of 128
INT4_CLIP_GRID = tuple(np.round(np.linspace(1.0, 0.75, 11), 3))  # range shrink factors the int4 clip search tries
DEFAULT_WINDOW_FRAMES = 3  # a checkpoint without a training record: the KV window of frames
FEW_ROWS_PER_INPUT = 4  # fewer calibration rows than this times a weight's inputs: warned (module docstring)


# ---- one linear weight -----------------------------------------------------------------------------------------

def _upper_inverse_cholesky(hessian: np.ndarray, damp: float) -> tuple[np.ndarray, np.ndarray]:
    """(U, dead): U upper triangular with U.T @ U = (H + damping)^-1, dead = columns no input reached."""
    H = np.array(hessian, dtype=np.float64)
    diag = np.diag(H).copy()
    dead = ~(diag > 0)
    H[dead, :] = 0.0
    H[:, dead] = 0.0
    H[dead, dead] = 1.0  # an unreached column: its own rounding error, no coupling to the others
    live = diag[~dead]
    H[np.diag_indices_from(H)] += damp * (float(live.mean()) if live.size else 1.0)
    try:
        L = np.linalg.cholesky(H)
    except np.linalg.LinAlgError as exc:
        raise ValueError(f"gptq: the damped Hessian is not positive definite ({exc}); raise damp") from exc
    Linv = np.linalg.solve(L, np.eye(len(H)))  # H^-1 = Linv.T @ Linv
    U = np.linalg.cholesky(Linv.T @ Linv).T  # upper Cholesky factor of H^-1, as the paper's sweep uses it
    return U, dead


def _int4_group_params(g: np.ndarray, weight: np.ndarray, clip_grid: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """Scales and zero points (float32, per row) of one group ``g`` (out, n) float32, the range shrunk by the factor
    of ``clip_grid`` with the least ``weight``-weighted squared error per row (factor 1: engine/quant.py's formula)."""
    lo0 = np.minimum(g.min(axis=1), 0).astype(np.float32)
    hi0 = np.maximum(g.max(axis=1), 0).astype(np.float32)
    best_err = best_s = best_z = None
    for a in clip_grid:
        s, z = int4_scale_zero((lo0 * np.float32(a)).astype(np.float32), (hi0 * np.float32(a)).astype(np.float32))
        q = int4_codes(g, s[:, None], z[:, None])
        err = (((q - z[:, None]) * s[:, None] - g).astype(np.float64) ** 2 * weight).sum(axis=1)
        if best_err is None:
            best_err, best_s, best_z = err, s, z
        else:
            better = err < best_err
            best_err = np.where(better, err, best_err)
            best_s, best_z = np.where(better, s, best_s), np.where(better, z, best_z)
    return best_s.astype(np.float32), best_z.astype(np.float32)


def gptq_linear(w, hessian, weight_dtype: str, group_size: int = GROUP_SIZE, damp: float = DAMP,
                block: int = BLOCK, int4_clip_grid: Sequence[float] = INT4_CLIP_GRID) -> QuantizedLinear:
    """W (out, in) -> QuantizedLinear in ``weight_dtype``'s layout, codes chosen by GPTQ for inputs whose second
    moment is ``hessian`` (in, in) = sum x x.T (module docstring). ``int4_clip_grid=(1.0,)`` turns the clip search
    off. bf16 is not quantised: its codes are the weights' bf16 bits."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {weight_dtype!r}")
    w32 = _finite_matrix(w, weight_dtype)
    if weight_dtype == "bf16":
        return quantize_bf16(w32)
    out, k = w32.shape
    hessian = np.asarray(hessian)
    if hessian.shape != (k, k) or not np.all(np.isfinite(hessian)):
        raise ValueError(f"gptq: the Hessian must be finite ({k}, {k}) for a weight with {k} inputs, "
                         f"got shape {hessian.shape}")
    if not (damp > 0) or not isinstance(block, int) or block < 1:
        raise ValueError(f"gptq: damp must be > 0 and block a positive integer, got {damp!r}, {block!r}")
    if weight_dtype == "int4":
        if not isinstance(group_size, int) or group_size < 2 or group_size % 2:
            raise ValueError(f"int4: group_size must be a positive even integer, got {group_size!r}")
        block = max(group_size, block // group_size * group_size)  # a group never straddles two blocks
        if not int4_clip_grid or any(not 0 < a <= 1 for a in int4_clip_grid):
            raise ValueError(f"int4_clip_grid: factors in (0, 1], got {int4_clip_grid!r}")
    U, dead = _upper_inverse_cholesky(hessian, damp)
    col_weight = np.where(dead, 0.0, np.diag(np.asarray(hessian, np.float64)))  # the clip search's error weights
    W = w32.astype(np.float64)
    codes = np.zeros((out, k), np.int16)
    scales = zeros = None
    if weight_dtype in ("int8", "fp8"):  # per row, from the ORIGINAL row, as engine/quant.py
        scales = row_scales(w32, weight_dtype)
        safe_row = _safe(scales)
    else:
        groups = math.ceil(k / group_size)
        scales, zeros = np.zeros((out, groups), np.float32), np.zeros((out, groups), np.float32)

    def quantise(i: int, col: np.ndarray) -> np.ndarray:
        """Column i (out,) float64 -> its dequantised values; records its codes."""
        x = col.astype(np.float32)
        if weight_dtype == "int8":
            q = int8_codes(x, safe_row)
            codes[:, i] = q
            return (q.astype(np.float32) * scales).astype(np.float64)
        if weight_dtype == "fp8":
            q = e4m3_encode(x / safe_row)
            codes[:, i] = q
            return (e4m3_decode(q) * scales).astype(np.float64)
        gi = i // group_size
        s, z = scales[:, gi], zeros[:, gi]
        q = int4_codes(x, s, z)
        codes[:, i] = q
        return ((q - z).astype(np.float32) * s).astype(np.float64)

    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        Wb = W[:, b0:b1].copy()
        errs = np.zeros_like(Wb)
        for j in range(b1 - b0):
            i = b0 + j
            if weight_dtype == "int4" and i % group_size == 0:
                g1 = min(i + group_size, k)  # inside this block (block is a multiple of group_size)
                scales[:, i // group_size], zeros[:, i // group_size] = _int4_group_params(
                    Wb[:, j:j + g1 - i].astype(np.float32), col_weight[i:g1], int4_clip_grid)
            deq = quantise(i, Wb[:, j])
            if dead[i]:
                continue  # nothing measured its error: round it and carry nothing
            e = (Wb[:, j] - deq) / U[i, i]
            Wb[:, j + 1:] -= np.outer(e, U[i, i + 1:b1])
            errs[:, j] = e
        W[:, b0:b1] = Wb
        if b1 < k:
            W[:, b1:] -= errs @ U[b0:b1, b1:]
    if weight_dtype == "int8":
        return QuantizedLinear("int8", codes.astype(np.int8), scales, (out, k))
    if weight_dtype == "fp8":
        return QuantizedLinear("fp8", codes.astype(np.uint8), scales, (out, k))
    return QuantizedLinear("int4", pack_int4(codes.astype(np.uint8)), scales, (out, k), zeros.astype(np.uint8),
                           group_size)


def output_error(w, q: QuantizedLinear, hessian) -> float:
    """sum over calibration rows of ||x (W - W').T||^2 = tr(D H D.T), D = W - W': what GPTQ minimises."""
    d = np.asarray(w, np.float64) - q.dequantize().astype(np.float64)
    return float(np.einsum("oi,ij,oj->", d, np.asarray(hessian, np.float64), d))


# ---- recording the inputs ---------------------------------------------------------------------------------------

class _RecordingWeight:
    """Stands for one linear weight in ``x @ w[name].T`` (engine/reference.py's only use of a linear weight):
    numpy defers ``x @ self`` to __rmatmul__ (``__array_ufunc__ = None``), which adds x.T x and multiplies."""
    __array_ufunc__ = None

    def __init__(self, recorder: "HessianRecorder", name: str, w: np.ndarray):
        self._recorder, self._name, self._w = recorder, name, w

    @property
    def T(self) -> "_RecordingWeight":
        return self

    def __rmatmul__(self, x):
        x = np.asarray(x)
        self._recorder.add(self._name, x.reshape(-1, x.shape[-1]))
        return x @ self._w.T


class HessianRecorder(dict):
    """The weights mapping the reference forward reads, with the linear weights ``names`` wrapped so each product
    ``x @ w[name].T`` also adds x.T x (float64) to ``hessians[name]`` and x's rows to ``rows[name]``."""

    def __init__(self, weights: Mapping[str, np.ndarray], names: Iterable[str]):
        super().__init__(weights)
        self.names = frozenset(names)
        missing = sorted(self.names - set(self))
        if missing:
            raise ValueError(f"HessianRecorder: no weight named {missing[0]}")
        self.hessians: dict[str, np.ndarray] = {}
        self.rows: dict[str, int] = {}

    def __getitem__(self, name):
        w = dict.__getitem__(self, name)
        return _RecordingWeight(self, name, w) if name in self.names else w

    def add(self, name: str, x: np.ndarray) -> None:
        x = np.asarray(x, np.float64)
        if name not in self.hessians:
            self.hessians[name] = np.zeros((x.shape[1], x.shape[1]))
            self.rows[name] = 0
        self.hessians[name] += x.T @ x
        self.rows[name] += x.shape[0]


# ---- streams of calibration frames ------------------------------------------------------------------------------

def kv_manager(cfg: ModelConfig, instruction: str, window_frames: int) -> KVManager:
    """FIFO under a budget of exactly the pinned instruction plus ``window_frames`` frames (new one included)."""
    tpf, P = cfg.n_patches, len(instruction.encode("utf-8"))
    budget = -(-(P + window_frames * tpf) // tpf) * tpf  # a multiple of tpf; the round-up holds < 1 more frame
    kv = KVManager(budget, tpf, P, policy="fifo", embed_dim=cfg.hidden_size)
    if kv.capacity_frames != window_frames:
        raise ValueError(f"KV window: budget {budget} holds {kv.capacity_frames} frames, not {window_frames}")
    return kv


def trained_window_frames(ckpt: str | Path) -> tuple[int, str]:
    """The KV window the checkpoint was trained for (training_record.json deploy.window_frames), else 3, and where
    the figure came from."""
    record = Path(ckpt) / "training_record.json"
    try:
        window = json.loads(record.read_text(encoding="utf-8"))["deploy"]["window_frames"]
    except (OSError, ValueError, KeyError, TypeError):
        return DEFAULT_WINDOW_FRAMES, "default"
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"{record}: deploy.window_frames must be an integer >= 1, got {window!r}")
    return window, f"{record.name} deploy.window_frames"


@dataclass
class CalibrationStreams:
    """Calibration sequences, each (instruction, frames in time order), streamed as an engine runs them: a fresh
    FIFO window of ``window_frames`` frames per sequence, every chunk's prefill and decode steps."""
    cfg: ModelConfig
    sequences: Sequence[tuple[str, Sequence[np.ndarray]]]
    window_frames: int = DEFAULT_WINDOW_FRAMES
    decode_tokens: int = 8

    def __post_init__(self):
        if not self.sequences or any(len(frames) == 0 for _, frames in self.sequences):
            raise ValueError("calibration: at least one sequence, and every sequence needs at least one frame")
        self._tokens: Optional[list[list[np.ndarray]]] = None

    @property
    def frames(self) -> int:
        return sum(len(frames) for _, frames in self.sequences)

    def hessians(self, weights: Mapping[str, np.ndarray], names: Iterable[str]) -> tuple[dict, dict]:
        """Stream every sequence through the reference forward on ``weights`` (float32); -> (name -> H = sum
        x x.T, name -> rows) for the linear weights ``names``."""
        if self._tokens is None:  # the vision front end is never quantised: its tokens are the same every pass
            wv = R.load_weights(self.cfg, weights, np.float32)
            self._tokens = [[R.patch_embed(self.cfg, wv, f) for f in frames] for _, frames in self.sequences]
        names = list(names)
        hessians: dict[str, np.ndarray] = {}
        rows: dict[str, int] = {n: 0 for n in names}
        first_id = 0
        for (instruction, _), tokens in zip(self.sequences, self._tokens):
            stream = R.start_stream(self.cfg, weights, kv_manager(self.cfg, instruction, self.window_frames),
                                    instruction, self.decode_tokens, dtype=np.float32)
            recorder = HessianRecorder(stream.w, names)
            stream.w = recorder
            for i, t in enumerate(tokens):
                R.reference_chunk(stream, t, first_id + i)
            first_id += len(tokens)
            for n in names:
                if n in recorder.hessians:
                    hessians[n] = hessians.get(n, 0) + recorder.hessians[n]
                    rows[n] += recorder.rows[n]
        unseen = [n for n in names if rows[n] == 0]
        if unseen:
            raise ValueError(f"calibration: no input reached {unseen[0]}")
        return hessians, rows


# the order a decoder layer's weights are calibrated in: each stage's inputs depend on the stages before it
STAGES = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
          ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))


def stage_names(tensors: Mapping[str, np.ndarray], layer: int, stage: Sequence[str]) -> list[str]:
    """The weights of ``stage`` (STAGES) in decoder layer ``layer`` among ``tensors``."""
    names = [f"model.layers.{layer}.{m}.weight" for m in stage]
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ValueError(f"calibrate: no tensor {missing[0]}")
    return names


def calibrate(cfg: ModelConfig, tensors: Mapping[str, np.ndarray], weight_dtype: str, streams: CalibrationStreams,
              group_size: int = GROUP_SIZE, damp: float = DAMP, int4_clip_grid: Sequence[float] = INT4_CLIP_GRID,
              progress: Optional[Callable[[str], None]] = print) -> QuantizedModel:
    """Every linear weight of ``tensors`` quantised by GPTQ, stage by stage (STAGES, layer by layer), each on the
    inputs it receives with everything before it already quantised (module docstring). -> the QuantizedModel
    quantize_weights would return (same layouts, same ``dense`` tensors), with per-tensor weight-error stats."""
    if weight_dtype not in WEIGHT_DTYPES or weight_dtype == "bf16":
        raise ValueError(f"calibrate: weight_dtype must be one of int8, fp8, int4, got {weight_dtype!r}")
    for layer in range(cfg.num_hidden_layers):  # every weight present before the first (long) pass
        for stage in STAGES:
            stage_names(tensors, layer, stage)
    current = {n: np.asarray(w, np.float32) for n, w in tensors.items()}
    linear, stats = {}, {}
    t0 = time.perf_counter()
    for layer in range(cfg.num_hidden_layers):
        rows: dict[str, int] = {}
        for stage in STAGES:
            names = stage_names(current, layer, stage)
            hessians, stage_rows = streams.hessians(current, names)
            rows.update(stage_rows)
            for n in names:
                linear[n] = gptq_linear(tensors[n], hessians[n], weight_dtype, group_size, damp,
                                        int4_clip_grid=int4_clip_grid)
                stats[n] = quant_stats(tensors[n], linear[n])
                current[n] = linear[n].dequantize()  # what follows calibrates on this weight's quantised output
        if progress is not None:
            few = sorted((n for n in rows if rows[n] < FEW_ROWS_PER_INPUT * tensors[n].shape[1]),
                         key=lambda n: rows[n] / tensors[n].shape[1])  # the worst first
            progress(f"calibrate {weight_dtype}: layer {layer + 1}/{cfg.num_hidden_layers}, "
                     f"{max(rows.values())} input rows per weight, {time.perf_counter() - t0:.1f} s"
                     + (f"; WARNING: {len(few)} weight(s) saw fewer than {FEW_ROWS_PER_INPUT} rows per input "
                        f"(e.g. {few[0]}: {rows[few[0]]} rows, {tensors[few[0]].shape[1]} inputs): "
                        "calibrate on more frames" if few else ""))
    dense = {n: np.asarray(w, np.float32) for n, w in tensors.items() if not is_quantized_name(n)}
    return QuantizedModel(weight_dtype, linear, dense, group_size if weight_dtype == "int4" else None, stats)
