"""What each weight_dtype costs and changes, side by side: bytes, weight error, and the model's output vs bf16.

    python -m vla_edge_ros.bench.quant_report [--checkpoint DIR] [--frames 3] [--decode-tokens 8] [--json OUT]

Why: issue 23's quality bar (cosine of the final hidden state and of the action logits vs bf16 >= 0.999 for
int8 / fp8, >= 0.99 for int4, per decode step; action-token agreement) has to be measured on the same frames for
every dtype in one run, or the figures are not comparable. The model here is engine/reference.py (the float64
oracle) run on engine/quant.py's dequantised weights, so the figures are the quantisation's alone, not a
kernel's rounding.

Per frame (prefix = the instruction, then the frame), two measurements:
- teacher forced: both models are fed the bf16 model's greedy tokens, so step i compares outputs on the SAME
  input: cosine of the final hidden state (before the final norm), of its residual part (hidden minus the
  step's input embedding: what the decoder layers added, the part quantisation touches; the tiny default's
  residual stream is dominated by its input), of the action logits, and whether the argmax agrees;
- free running: reference_chunk on each model's own stream (a KV manager each), as an engine runs: whether the
  action bins of the chunk are equal.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from vla_edge_ros.core.kv.manager import KVManager
from vla_edge_ros.engine import reference as R
from vla_edge_ros.engine.checkpoint import load_checkpoint
from vla_edge_ros.engine.config import ModelConfig
from vla_edge_ros.engine.quant import WEIGHT_DTYPES, QuantizedModel, quantize_weights

INSTRUCTION = "pick up the object"
THRESHOLDS = {"bf16": 0.999, "int8": 0.999, "fp8": 0.999, "int4": 0.99}  # issue 23's cosine bars


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
    denom = np.linalg.norm(a) * np.linalg.norm(b)
    if denom == 0:
        raise ValueError("cosine of a zero vector")
    return float(a @ b / denom)


@dataclass
class Quality:
    """Per decode step (index 0 = the frame's last token, i = decode step i), the minimum over frames."""
    hidden_cos: list[float]
    residual_cos: list[float]
    logits_cos: list[float]
    token_agreement: float  # teacher forced: argmax equal, over all frames and steps
    chunk_action_agreement: float  # free running: fraction of chunks whose action bins are all equal
    bin_agreement: float  # free running: fraction of action bins equal


def sample_frames(n: int, seed: int = 0) -> list[np.ndarray]:
    """Camera-like uint8 images, fixed by the seed."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (120, 160, 3), dtype=np.uint8) for _ in range(n)]


def _teacher_forced(cfg: ModelConfig, ws: Sequence[Mapping[str, np.ndarray]], tokens: np.ndarray,
                    decode_tokens: int):
    """Per step: (hidden, input) of each model in ``ws`` and its logits; ws[0] chooses the tokens."""
    ids = list(INSTRUCTION.encode("utf-8"))
    prefix = [R.forward(cfg, w, R.embed(w, ids))[1] for w in ws]
    P, tpf = len(ids), len(tokens)
    frame = [R.forward(cfg, w, tokens, np.arange(P, P + tpf), p) for w, p in zip(ws, prefix)]
    pasts = [[(np.concatenate([pk, k]), np.concatenate([pv, v])) for (pk, pv), (k, v) in zip(p, f[1])]
             for p, f in zip(prefix, frame)]  # per model, per layer: prefix + frame keys / values (pre-RoPE)
    h = [f[0][-1:] for f in frame]  # the frame's last row
    x_in = [np.asarray(tokens[-1:], np.float64)] * len(ws)
    steps = []
    for i in range(decode_tokens + 1):
        logits = [R.action_logits(cfg, w, hh)[0] for w, hh in zip(ws, h)]
        steps.append((h, x_in, logits))
        if i == decode_tokens:
            break
        token = int(np.argmax(logits[0])) + cfg.action_token_offset  # the first model's choice, fed to all
        x_in = [R.embed(w, [token]) for w in ws]
        outs = [R.forward(cfg, w, x, [P + tpf + i], past) for w, x, past in zip(ws, x_in, pasts)]
        h = [o[0] for o in outs]
        pasts = [[(np.concatenate([pk, k]), np.concatenate([pv, v])) for (pk, pv), (k, v) in zip(past, o[1])]
                 for past, o in zip(pasts, outs)]
    return steps


def _kv(cfg: ModelConfig, frames: int) -> KVManager:
    tpf = cfg.n_patches
    budget = -(-(len(INSTRUCTION) + frames * tpf) // tpf) * tpf
    return KVManager(budget, tpf, len(INSTRUCTION), policy="fifo", embed_dim=cfg.hidden_size)


def measure_quality(cfg: ModelConfig, base: Mapping[str, np.ndarray], quantized: Mapping[str, np.ndarray],
                    images: Sequence[np.ndarray], decode_tokens: int = 8) -> Quality:
    """``quantized`` (e.g. QuantizedModel.dequantized()) against ``base`` (the bf16 weights) on ``images``."""
    wb, wq = R.load_weights(cfg, base), R.load_weights(cfg, quantized)
    hidden, residual, logit = ([[] for _ in range(decode_tokens + 1)] for _ in range(3))
    agree = []
    sb = R.start_stream(cfg, base, _kv(cfg, 3), INSTRUCTION, decode_tokens)
    sq = R.start_stream(cfg, quantized, _kv(cfg, 3), INSTRUCTION, decode_tokens)
    chunks, bins = [], []
    for fid, image in enumerate(images):
        tokens = R.patch_embed(cfg, wb, image)  # vision is not quantised: the same tokens for both
        for i, (h, x_in, lg) in enumerate(_teacher_forced(cfg, [wb, wq], tokens, decode_tokens)):
            hidden[i].append(cosine(h[0], h[1]))
            residual[i].append(cosine(h[0] - x_in[0], h[1] - x_in[1]))
            logit[i].append(cosine(lg[0], lg[1]))
            agree.append(int(np.argmax(lg[0])) == int(np.argmax(lg[1])))
        a, b = R.reference_chunk(sb, tokens, fid), R.reference_chunk(sq, tokens, fid)
        chunks.append(bool(np.array_equal(a.action_bins, b.action_bins)))
        bins.extend(a.action_bins == b.action_bins)
    return Quality([min(c) for c in hidden], [min(c) for c in residual], [min(c) for c in logit],
                   float(np.mean(agree)), float(np.mean(chunks)), float(np.mean(bins)))


def report(cfg: ModelConfig, weights: Mapping[str, np.ndarray], dtypes: Sequence[str] = WEIGHT_DTYPES,
           frames: int = 3, decode_tokens: int = 8, seed: int = 0) -> dict[str, dict]:
    """Per weight_dtype: bytes, weight error, Quality (asdict) vs the bf16 model, in one run on the same frames."""
    images = sample_frames(frames, seed)
    models: dict[str, QuantizedModel] = {wd: quantize_weights(weights, wd) for wd in dtypes}
    base = models["bf16"] if "bf16" in models else quantize_weights(weights, "bf16")
    base_w = base.dequantized()
    out = {}
    for wd, m in models.items():
        stats = list(m.stats.values())
        out[wd] = {"linear_bytes": m.linear_bytes(), "model_bytes": m.total_bytes(),
                   "linear_vs_bf16": m.linear_bytes() / base.linear_bytes(),
                   "max_rel_frobenius_error": max(s.rel_frobenius_error for s in stats),
                   "mean_rel_frobenius_error": float(np.mean([s.rel_frobenius_error for s in stats])),
                   "max_abs_error": max(s.max_abs_error for s in stats),
                   "threshold": THRESHOLDS[wd],
                   **asdict(measure_quality(cfg, base_w, m.dequantized(), images, decode_tokens))}
    return out


def print_report(rows: Mapping[str, dict]) -> None:
    print(f"{'':28s}" + "".join(f"{wd:>12s}" for wd in rows))
    for key, fmt in (("linear_bytes", "{:12,d}"), ("model_bytes", "{:12,d}"), ("linear_vs_bf16", "{:12.3f}"),
                     ("max_rel_frobenius_error", "{:12.2e}"), ("mean_rel_frobenius_error", "{:12.2e}"),
                     ("max_abs_error", "{:12.2e}"), ("token_agreement", "{:12.3f}"),
                     ("chunk_action_agreement", "{:12.3f}"), ("bin_agreement", "{:12.3f}"),
                     ("threshold", "{:12.3f}")):
        print(f"{key:28s}" + "".join(fmt.format(r[key]) for r in rows.values()))
    steps = len(next(iter(rows.values()))["hidden_cos"])
    for key in ("hidden_cos", "residual_cos", "logits_cos"):
        for i in range(steps):
            label = f"{key} step {i}" + (" (frame)" if i == 0 else "")
            print(f"{label:28s}" + "".join(f"{r[key][i]:12.6f}" for r in rows.values()))
    for wd, r in rows.items():
        worst = min(min(r["hidden_cos"]), min(r["logits_cos"]))
        verdict = "meets" if worst >= r["threshold"] else "MISSES"
        print(f"{wd}: worst hidden/logits cosine {worst:.6f} {verdict} the {r['threshold']} bar")


def main(argv: list[str] | None = None) -> None:
    """Per weight_dtype bytes, error and cosines vs bf16: python -m vla_edge_ros.bench.quant_report"""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--checkpoint", default="", help="HF-layout bf16 checkpoint (default: the tiny default)")
    ap.add_argument("--frames", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="", help="also write the figures here")
    args = ap.parse_args(argv)
    if args.checkpoint:
        ckpt = Path(args.checkpoint)
    else:
        from vla_edge_ros.engine.tiny_default import ensure_tiny_default
        ckpt = ensure_tiny_default()
    cfg = ModelConfig.from_json(ckpt)
    rows = report(cfg, load_checkpoint(ckpt, cfg), frames=args.frames, decode_tokens=args.decode_tokens,
                  seed=args.seed)
    print(f"checkpoint {ckpt}: {args.frames} frames, {args.decode_tokens} decode steps, reference forward "
          "(float64) on dequantised weights; cosines are the minimum over frames")
    print_report(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
