"""What each weight_dtype costs and changes, side by side: bytes, weight error, and the model's output vs bf16.

    python -m vla_edge_ros.bench.quant_report [--checkpoint DIR] [--frames-from random|bridge|sim] [--task push]
        [--seeds 3] [--every 1] [--episodes 4] [--frames N] [--window-frames W] [--decode-tokens 8] [--json OUT]
        [--calibrate-tasks push,button-press-topdown,drawer-close [--calibrate-seeds 2] [--calibrate-every 2]]

Why: issue 23's quality bar (cosine of the final hidden state and of the action logits vs bf16 >= 0.999 for
int8 / fp8, >= 0.99 for int4, per decode step; action-token agreement with the bf16 engine on the frames of the
real Bridge clip and on the sim episodes) has to be measured on the same frames for every dtype in one run, or
the figures are not comparable. The model here is engine/reference.py (the float64 oracle) run on
engine/quant.py's dequantised weights, so the figures are the quantisation's alone, not a kernel's rounding.
The frames come from bench/quant_frames.py: noise (the default), the Bridge sample or MetaWorld expert rollouts,
as sequences of consecutive frames of one episode each, with that episode's instruction.

Two measurements, every dtype against the bf16 model:
- teacher forced, per frame (prefix = the instruction, then the frame alone): every model is fed the bf16
  model's greedy tokens, so step i compares outputs on the SAME input: cosine of the final hidden state (before
  the final norm), of its residual part (hidden minus the step's input embedding: what the decoder layers added,
  the part quantisation touches; the tiny default's residual stream is dominated by its input), of the action
  logits, and whether the argmax agrees;
- streaming, per sequence: reference_chunk on each model's own stream (its own KV manager keeping a window of
  ``window_frames`` frames, fresh per sequence) as an engine runs, over all H x action_dims bins of every chunk:
  the fraction of chunks whose bins all equal bf16's, per-dimension bin agreement, mean |bin difference| per
  dimension and the largest action difference in the action's own units (the tokenizer's un-normalisation).
The window defaults to the checkpoint's training_record.json deploy.window_frames (the context it was trained
with: 1 past frame -> 2), else 3.

``--calibrate-tasks`` adds a column ``<type>-gptq`` per quantised type: the same layout with its codes chosen by
GPTQ (engine/quant_gptq.py), calibrated on sim expert frames of those tasks from seeds 1 000 000 on (where the
demonstrations come from), never the evaluated seeds: round-to-nearest and calibrated side by side, same frames.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Mapping, Optional, Sequence

import numpy as np

from vla_edge_ros.bench.quant_frames import (DEFAULT_INSTRUCTION, FRAME_SOURCES, SHARED_OXE, FrameSequence,
                                             bridge_sequences, random_sequences, sample_frames, sim_sequences)
from vla_edge_ros.engine import reference as R
from vla_edge_ros.engine.checkpoint import load_checkpoint
from vla_edge_ros.engine.config import ModelConfig
from vla_edge_ros.engine.factory import resolve_checkpoint
from vla_edge_ros.engine.geometry import chunk_decode_steps
from vla_edge_ros.engine.quant import WEIGHT_DTYPES, QuantizedModel, quantize_weights
from vla_edge_ros.engine.quant_gptq import DEFAULT_WINDOW_FRAMES, CalibrationStreams, calibrate, kv_manager
from vla_edge_ros.engine.quant_gptq import trained_window_frames as default_window_frames

__all__ = ["INSTRUCTION", "THRESHOLDS", "cosine", "sample_frames", "kv_manager", "stream_chunks",
           "streaming_agreement", "measure", "report", "print_report", "main"]

INSTRUCTION = DEFAULT_INSTRUCTION
THRESHOLDS = {"bf16": 0.999, "int8": 0.999, "fp8": 0.999, "int4": 0.99}  # issue 23's cosine bars
CALIBRATED = "-gptq"  # the column of a weight type whose codes GPTQ chose (engine/quant_gptq.py)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
    denom = np.linalg.norm(a) * np.linalg.norm(b)
    if denom == 0:
        raise ValueError("cosine of a zero vector")
    return float(a @ b / denom)


# ---- teacher forced ---------------------------------------------------------------------------------------------

def _teacher_forced(cfg: ModelConfig, ws: Sequence[Mapping[str, np.ndarray]], instruction: str, tokens: np.ndarray,
                    decode_steps: int):
    """Per step: (hidden, input) of each model in ``ws`` and its logits; ws[0] chooses the tokens."""
    ids = list(instruction.encode("utf-8"))
    prefix = [R.forward(cfg, w, R.embed(w, ids))[1] for w in ws]
    P, tpf = len(ids), len(tokens)
    frame = [R.forward(cfg, w, tokens, np.arange(P, P + tpf), p) for w, p in zip(ws, prefix)]
    pasts = [[(np.concatenate([pk, k]), np.concatenate([pv, v])) for (pk, pv), (k, v) in zip(p, f[1])]
             for p, f in zip(prefix, frame)]  # per model, per layer: prefix + frame keys / values (pre-RoPE)
    h = [f[0][-1:] for f in frame]  # the frame's last row
    x_in = [np.asarray(tokens[-1:], np.float64)] * len(ws)
    steps = []
    for i in range(decode_steps + 1):
        logits = [R.action_logits(cfg, w, hh)[0] for w, hh in zip(ws, h)]
        steps.append((h, x_in, logits))
        if i == decode_steps:
            break
        token = int(np.argmax(logits[0])) + cfg.action_token_offset  # the first model's choice, fed to all
        x_in = [R.embed(w, [token]) for w in ws]
        outs = [R.forward(cfg, w, x, [P + tpf + i], past) for w, x, past in zip(ws, x_in, pasts)]
        h = [o[0] for o in outs]
        pasts = [[(np.concatenate([pk, k]), np.concatenate([pv, v])) for (pk, pv), (k, v) in zip(past, o[1])]
                 for past, o in zip(pasts, outs)]
    return steps


# ---- streaming --------------------------------------------------------------------------------------------------

def stream_chunks(cfg: ModelConfig, weights: Mapping[str, np.ndarray], instruction: str,
                  frame_tokens: Sequence[np.ndarray], decode_tokens: int, window_frames: int,
                  first_frame_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """One model's chunks over one sequence, as an engine streams it. -> bins (N, H, dims) int64 and the
    un-normalised actions (N, H, dims) float32 of its N = len(frame_tokens) chunks."""
    stream = R.start_stream(cfg, weights, kv_manager(cfg, instruction, window_frames), instruction, decode_tokens)
    chunks = [R.reference_chunk(stream, t, first_frame_id + i) for i, t in enumerate(frame_tokens)]
    return np.stack([c.chunk_bins for c in chunks]), np.stack([c.chunk for c in chunks])


def streaming_agreement(base_bins: np.ndarray, bins: np.ndarray, base_actions: np.ndarray,
                        actions: np.ndarray) -> dict:
    """Chunks (N, H, dims) of a model against the bf16 model's on the same frames: agreement figures."""
    base_bins, bins = np.asarray(base_bins, np.int64), np.asarray(bins, np.int64)
    if base_bins.shape != bins.shape or base_bins.ndim != 3 or np.shape(actions) != bins.shape \
            or np.shape(base_actions) != bins.shape:
        raise ValueError(f"chunks must all be (N, H, dims): bins {base_bins.shape} / {bins.shape}, actions "
                         f"{np.shape(base_actions)} / {np.shape(actions)}")
    equal = base_bins == bins
    diff = np.abs(base_bins - bins)
    action_diff = np.abs(np.asarray(base_actions, np.float64) - np.asarray(actions, np.float64))
    return {"chunks": int(bins.shape[0]),
            "chunk_action_agreement": float(np.mean(np.all(equal, axis=(1, 2)))),
            "bin_agreement": float(np.mean(equal)),
            "bin_agreement_per_dim": np.mean(equal, axis=(0, 1)).tolist(),
            "bin_agreement_per_step_dim": np.mean(equal, axis=0).tolist(),
            "mean_abs_bin_diff_per_dim": np.mean(diff, axis=(0, 1)).tolist(),
            "max_abs_bin_diff": int(diff.max()),
            "max_action_diff_per_dim": action_diff.max(axis=(0, 1)).tolist(),
            "max_action_diff": float(action_diff.max())}


def measure(cfg: ModelConfig, base: Mapping[str, np.ndarray], models: Mapping[str, Mapping[str, np.ndarray]],
            sequences: Sequence[FrameSequence], decode_tokens: int = 8,
            window_frames: int = DEFAULT_WINDOW_FRAMES) -> dict[str, dict]:
    """Each of ``models`` (name -> weights, e.g. QuantizedModel.dequantized()) against ``base`` (the bf16
    weights) on ``sequences``: teacher-forced cosines per decode step (minimum over frames), argmax agreement,
    and streaming_agreement over all chunks of all sequences."""
    if not sequences or any(not s.frames for s in sequences):
        raise ValueError("measure: every sequence needs at least one frame")
    wb = R.load_weights(cfg, base)
    ws = {name: R.load_weights(cfg, w) for name, w in models.items()}
    steps = chunk_decode_steps(cfg, decode_tokens)
    cos = {name: {k: [[] for _ in range(steps + 1)] for k in ("hidden", "residual", "logits")} for name in ws}
    agree: dict[str, list[bool]] = {name: [] for name in ws}
    runs: dict[str, list] = {name: [] for name in ["<base>", *ws]}
    first_id = 0
    for seq in sequences:
        tokens = [R.patch_embed(cfg, wb, image) for image in seq.frames]  # vision is not quantised: shared
        for tok in tokens:
            for i, (h, x_in, lg) in enumerate(_teacher_forced(cfg, [wb, *ws.values()], seq.instruction, tok,
                                                              steps)):
                for j, name in enumerate(ws, start=1):
                    cos[name]["hidden"][i].append(cosine(h[0], h[j]))
                    cos[name]["residual"][i].append(cosine(h[0] - x_in[0], h[j] - x_in[j]))
                    cos[name]["logits"][i].append(cosine(lg[0], lg[j]))
                    agree[name].append(int(np.argmax(lg[0])) == int(np.argmax(lg[j])))
        for name, w in [("<base>", wb), *ws.items()]:  # each model on its own stream, own KV manager
            runs[name].append(stream_chunks(cfg, w, seq.instruction, tokens, decode_tokens, window_frames, first_id))
        first_id += len(tokens)
    base_bins, base_actions = (np.concatenate([r[k] for r in runs["<base>"]]) for k in (0, 1))
    out = {}
    for name in ws:
        bins, actions = (np.concatenate([r[k] for r in runs[name]]) for k in (0, 1))
        out[name] = {"hidden_cos": [min(c) for c in cos[name]["hidden"]],
                     "residual_cos": [min(c) for c in cos[name]["residual"]],
                     "logits_cos": [min(c) for c in cos[name]["logits"]],
                     "token_agreement": float(np.mean(agree[name])),
                     **streaming_agreement(base_bins, bins, base_actions, actions)}
    return out


def report(cfg: ModelConfig, weights: Mapping[str, np.ndarray], dtypes: Sequence[str] = WEIGHT_DTYPES,
           frames: int = 3, decode_tokens: int = 8, seed: int = 0,
           sequences: Optional[Sequence[FrameSequence]] = None,
           window_frames: int = DEFAULT_WINDOW_FRAMES,
           calibration: Optional[CalibrationStreams] = None) -> dict[str, dict]:
    """Per weight_dtype: bytes, weight error and the measure() figures vs the bf16 model, in one run on the same
    frames: ``sequences`` (default: ``frames`` random frames of ``seed``). With ``calibration``, every quantised
    type also gets a column ``<type>-gptq``: its codes chosen by GPTQ on those calibration streams."""
    sequences = random_sequences(frames, seed) if sequences is None else sequences
    models: dict[str, QuantizedModel] = {wd: quantize_weights(weights, wd) for wd in dtypes}
    if calibration is not None:
        for wd in [wd for wd in dtypes if wd != "bf16"]:
            models[wd + CALIBRATED] = calibrate(cfg, weights, wd, calibration)
    base = models["bf16"] if "bf16" in models else quantize_weights(weights, "bf16")
    quality = measure(cfg, base.dequantized(), {wd: m.dequantized() for wd, m in models.items()}, sequences,
                      decode_tokens, window_frames)
    out = {}
    for wd, m in models.items():
        stats = list(m.stats.values())
        out[wd] = {"linear_bytes": m.linear_bytes(), "model_bytes": m.total_bytes(),
                   "linear_vs_bf16": m.linear_bytes() / base.linear_bytes(),
                   "max_rel_frobenius_error": max(s.rel_frobenius_error for s in stats),
                   "mean_rel_frobenius_error": float(np.mean([s.rel_frobenius_error for s in stats])),
                   "max_abs_error": max(s.max_abs_error for s in stats),
                   "threshold": THRESHOLDS[m.weight_dtype], **quality[wd]}
    return out


# ---- output -----------------------------------------------------------------------------------------------------

MAX_STEP_ROWS = 16  # more decode steps than this (action_horizon > 1): the frame step and the decode minimum


def _row(label: str, values: Sequence, fmt: str) -> str:
    return f"{label:28s}" + "".join(fmt.format(v) for v in values)


def print_report(rows: Mapping[str, dict], action_names: Optional[Sequence[str]] = None) -> None:
    """All dtypes side by side: one column each."""
    rs = list(rows.values())
    print(f"{'':28s}" + "".join(f"{wd:>12s}" for wd in rows))
    for key, fmt in (("linear_bytes", "{:12,d}"), ("model_bytes", "{:12,d}"), ("linear_vs_bf16", "{:12.3f}"),
                     ("max_rel_frobenius_error", "{:12.2e}"), ("mean_rel_frobenius_error", "{:12.2e}"),
                     ("max_abs_error", "{:12.2e}"), ("token_agreement", "{:12.3f}"), ("chunks", "{:12d}"),
                     ("chunk_action_agreement", "{:12.3f}"), ("bin_agreement", "{:12.3f}"),
                     ("max_abs_bin_diff", "{:12d}"), ("max_action_diff", "{:12.3g}"), ("threshold", "{:12.3f}")):
        print(_row(key, [r[key] for r in rs], fmt))
    dims = len(rs[0]["bin_agreement_per_dim"])
    names = list(action_names) if action_names is not None else [f"dim{d}" for d in range(dims)]
    for key, label, fmt in (("bin_agreement_per_dim", "bin agreement", "{:12.3f}"),
                            ("mean_abs_bin_diff_per_dim", "mean |bin diff|", "{:12.3f}"),
                            ("max_action_diff_per_dim", "max |action diff|", "{:12.3g}")):
        for d in range(dims):
            print(_row(f"{label} {names[d]}", [r[key][d] for r in rs], fmt))
    steps = len(rs[0]["hidden_cos"])
    for key in ("hidden_cos", "residual_cos", "logits_cos"):
        if steps <= MAX_STEP_ROWS:
            for i in range(steps):
                print(_row(f"{key} step {i}" + (" (frame)" if i == 0 else ""), [r[key][i] for r in rs], "{:12.6f}"))
        else:
            print(_row(f"{key} step 0 (frame)", [r[key][0] for r in rs], "{:12.6f}"))
            print(_row(f"{key} min steps 1-{steps - 1}", [min(r[key][1:]) for r in rs], "{:12.6f}"))
    for wd, r in rows.items():
        worst = min(min(r["hidden_cos"]), min(r["logits_cos"]))
        verdict = "meets" if worst >= r["threshold"] else "MISSES"
        print(f"{wd}: worst hidden/logits cosine {worst:.6f} {verdict} the {r['threshold']} bar")


def main(argv: list[str] | None = None) -> None:
    """Per weight_dtype bytes, error, cosines and action agreement vs bf16: python -m vla_edge_ros.bench.quant_report"""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--checkpoint", default="",
                    help="HF-layout bf16 checkpoint or a shipped policy's name (default: the tiny default)")
    ap.add_argument("--frames-from", choices=FRAME_SOURCES, default="random")
    ap.add_argument("--frames", type=int, default=None,
                    help="random: how many (default 3); bridge / sim: at most this many per sequence (default all)")
    ap.add_argument("--seed", type=int, default=0, help="random: the frames' seed; sim: the first seed")
    ap.add_argument("--task", default="push", help="sim: the task (sim/tasks.py)")
    ap.add_argument("--seeds", type=int, default=3, help="sim: how many seeds (one sequence each)")
    ap.add_argument("--every", type=int, default=1, help="sim: a frame every k-th control step")
    ap.add_argument("--camera", default=None, help="sim: the camera (default sim/tasks.py DEFAULT_CAMERA)")
    ap.add_argument("--episodes", type=int, default=4, help="bridge: the first N episodes (one sequence each)")
    ap.add_argument("--bridge-dir", default=str(SHARED_OXE), help="bridge: the RLDS dataset directory")
    ap.add_argument("--window-frames", type=int, default=None,
                    help="frames the streaming KV keeps (default: the checkpoint's training record, else 3)")
    ap.add_argument("--decode-tokens", type=int, default=8)
    ap.add_argument("--dtypes", nargs="+", choices=WEIGHT_DTYPES, default=list(WEIGHT_DTYPES))
    ap.add_argument("--json", default="", help="also write the figures here")
    ap.add_argument("--calibrate-tasks", default="",
                    help="also GPTQ-calibrated columns (<type>-gptq), calibrated on sim expert frames of these "
                         "comma-separated tasks (e.g. the policy's training tasks)")
    ap.add_argument("--calibrate-seeds", type=int, default=2, help="calibration: seeds per task")
    ap.add_argument("--calibrate-seed-start", type=int, default=1_000_000,
                    help="calibration: the first seed (default: where sim/demos.py's demonstrations start, apart "
                         "from the evaluation's 0, 1, ...)")
    ap.add_argument("--calibrate-every", type=int, default=2, help="calibration: a frame every k-th step")
    args = ap.parse_args(argv)
    cal_tasks = [t for t in args.calibrate_tasks.split(",") if t]
    cal_seeds = range(args.calibrate_seed_start, args.calibrate_seed_start + args.calibrate_seeds)
    if args.frames_from == "sim" and args.task in cal_tasks and set(cal_seeds) & set(range(args.seed,
                                                                                             args.seed + args.seeds)):
        ap.error(f"calibration seeds {cal_seeds.start}..{cal_seeds.stop - 1} of {args.task} overlap the evaluated "
                 f"seeds {args.seed}..{args.seed + args.seeds - 1}: a model must not be judged on the frames it was "
                 "calibrated on")
    ckpt = resolve_checkpoint(args.checkpoint)  # a path, a shipped policy's name, or empty: the tiny default
    cfg = ModelConfig.from_json(ckpt)
    window, window_from = ((args.window_frames, "--window-frames") if args.window_frames is not None
                           else default_window_frames(ckpt))
    image_hw = (cfg.patch_grid[0] * cfg.patch_size, cfg.patch_grid[1] * cfg.patch_size)  # sim renders at it
    if args.frames_from == "random":
        sequences = random_sequences(3 if args.frames is None else args.frames, args.seed)
    elif args.frames_from == "bridge":
        sequences = bridge_sequences(args.bridge_dir, args.episodes, args.frames)
    else:
        sequences = sim_sequences(args.task, args.seeds, args.seed, args.every, args.frames, image_hw, args.camera)
    calibration = None
    if cal_tasks:
        cal = [s for t in cal_tasks for s in sim_sequences(t, args.calibrate_seeds, args.calibrate_seed_start,
                                                           args.calibrate_every, None, image_hw, args.camera)]
        calibration = CalibrationStreams(cfg, [(s.instruction, s.frames) for s in cal], window, args.decode_tokens)
        print(f"calibration (GPTQ columns): {calibration.frames} frames of {', '.join(cal_tasks)}, seeds "
              f"{cal_seeds.start}..{cal_seeds.stop - 1}, every {args.calibrate_every} steps", flush=True)
    rows = report(cfg, load_checkpoint(ckpt, cfg), args.dtypes, decode_tokens=args.decode_tokens,
                  sequences=sequences, window_frames=window, calibration=calibration)
    steps = chunk_decode_steps(cfg, args.decode_tokens)
    print(f"checkpoint {ckpt}: frames from {args.frames_from}, {sum(len(s.frames) for s in sequences)} frames in "
          f"{len(sequences)} sequence(s), KV window {window} frames ({window_from}), {steps} decode steps, "
          f"action_horizon {cfg.action_horizon}; reference forward (float64) on dequantised weights; cosines are "
          "the minimum over frames, agreement is over all chunks and all H x dims bins")
    for s in sequences:
        print(f"  {s.name}: {len(s.frames)} frames, instruction {s.instruction!r}")
    print_report(rows, cfg.action_names)
    if args.json:
        doc = {"checkpoint": str(ckpt), "frames_from": args.frames_from, "window_frames": window,
               "window_from": window_from, "decode_tokens": args.decode_tokens, "decode_steps": steps,
               "action_horizon": int(cfg.action_horizon), "action_names": list(cfg.action_names),
               "sequences": [s.describe() for s in sequences], "dtypes": rows,
               "calibration": None if calibration is None else {
                   "tasks": args.calibrate_tasks, "seed_start": args.calibrate_seed_start,
                   "seeds": args.calibrate_seeds, "every": args.calibrate_every, "frames": calibration.frames}}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
