"""`vla_quantize`: a pre-quantised checkpoint, its codes calibrated on the robot's own demonstrations (GPTQ).

    vla_quantize SRC DST --weight-dtype int8|fp8|int4 [--calibrate BAG [BAG ...]] [--episodes 12] [--every 1]
                 [--window-frames W] [--decode-tokens 8] [--damp 0.01]

Why a step of its own: round-to-nearest (what the engines do when handed a bf16 checkpoint with weight_dtype int4)
needs no data, but it chooses each weight's code for that weight alone. GPTQ (engine/quant_gptq.py) chooses them
for the layer's output on the inputs the policy really gets, which on the shipped policy lifts fp8's worst cosine
against bf16 from 0.9957 to 0.9991 and int4's from 0.9655 to 0.9912 (docs/QUANTIZATION.md). Those inputs are
frames of the robot's own task: the demonstration bags the policy was trained from (vla_sim_demos' or the robot's
own recordings, read by data/bag_reader.py) are the natural source. Without ``--calibrate`` the codes are
round-to-nearest, exactly what the engines compute at load (engine/quant_checkpoint.py's command).

Calibration frames: ``--episodes`` episodes spread evenly over all episodes of the bags (the first, the last and
evenly between; every bag contributes when there are at least as many episodes as bags), every ``--every``-th
step of each, streamed through the KV window the checkpoint was trained with (training_record.json
deploy.window_frames, else 3). Keep them apart from the episodes you evaluate on.

DST receives the documented pre-quantised layout (config.json with its ``quantization`` block and
model.quantized.safetensors: load it with ``checkpoint:=DST weight_dtype:=<type>``), the source's
training_record.json when it has one (its ``deploy`` block still describes how to run the policy), and
quantization_record.json: the method, the calibration data (bags, their digest, the episodes), the settings, the
per-weight error and the time taken. Nothing is overwritten: DST must not exist or be empty.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

RECORD_FILE = "quantization_record.json"


def spread(n_total: int, n_pick: int) -> list[int]:
    """``n_pick`` indices spread evenly over range(n_total), first and last included (all when n_pick >= n_total)."""
    if n_pick >= n_total:
        return list(range(n_total))
    if n_pick == 1:
        return [0]
    return sorted({int(round(i * (n_total - 1) / (n_pick - 1))) for i in range(n_pick)})


def calibration_sequences(bags: Sequence[str], episodes: int, every: int):
    """-> (sequences [(instruction, frames)], what was read: per chosen episode its bag, index and frames)."""
    from vla_edge_ros.data.bag_reader import read_bags

    eps, summaries = read_bags(bags)
    for s in summaries:
        print(s.text())
    if not eps:
        raise ValueError(f"no episode with frames in {', '.join(bags)}")
    chosen = [eps[i] for i in spread(len(eps), episodes)]
    seqs, used = [], []
    for e in chosen:
        frames = list(e.frames[::every])
        seqs.append((e.instruction, frames))
        used.append({"bag": e.bag, "episode": int(e.index), "instruction": e.instruction, "frames": len(frames)})
    return seqs, used


def build_parser() -> argparse.ArgumentParser:
    from vla_edge_ros.engine.quant_gptq import DAMP
    p = argparse.ArgumentParser(prog="vla_quantize", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="plain checkpoint directory (config.json + safetensors) or a shipped policy's name")
    p.add_argument("dst", help="new directory for the pre-quantised checkpoint")
    p.add_argument("--weight-dtype", required=True, choices=["int8", "fp8", "int4"])
    p.add_argument("--calibrate", nargs="+", default=[], metavar="BAG",
                   help="demonstration bags to calibrate on (GPTQ); without: round to nearest")
    p.add_argument("--episodes", type=int, default=12, help="calibration episodes, spread over all the bags'")
    p.add_argument("--every", type=int, default=1, help="a frame every k-th step of each episode")
    p.add_argument("--window-frames", type=int, default=None,
                   help="frames the KV window keeps (default: the training record's, else 3)")
    p.add_argument("--decode-tokens", type=int, default=8)
    p.add_argument("--damp", type=float, default=DAMP, help="GPTQ damping, a fraction of the mean Hessian diagonal")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    from vla_edge_ros.data.bag_reader import BagReadError, bag_digest
    from vla_edge_ros.engine import quant_gptq as G
    from vla_edge_ros.engine.checkpoint import load_checkpoint
    from vla_edge_ros.engine.config import ModelConfig
    from vla_edge_ros.engine.factory import resolve_checkpoint
    from vla_edge_ros.engine.interface import EngineError
    from vla_edge_ros.engine.quant import quantize_weights
    from vla_edge_ros.engine.quant_checkpoint import QUANT_FILE, refuse_requantizing, write_quantized_checkpoint

    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    try:
        if args.episodes < 1 or args.every < 1 or not args.damp > 0:
            raise ValueError(f"--episodes and --every must be >= 1 and --damp > 0, got {args.episodes}, "
                             f"{args.every}, {args.damp}")
        src, dst = resolve_checkpoint(args.src), Path(args.dst)
        refuse_requantizing(src, dst)
        cfg_dict = json.loads((src / "config.json").read_text(encoding="utf-8"))
        cfg = ModelConfig.from_json(cfg_dict)
        tensors = load_checkpoint(src, cfg)
        record: dict = {"source": str(src), "weight_dtype": args.weight_dtype}
        if args.calibrate:
            window, window_from = ((args.window_frames, "--window-frames") if args.window_frames is not None
                                   else G.trained_window_frames(src))
            seqs, used = calibration_sequences(args.calibrate, args.episodes, args.every)
            streams = G.CalibrationStreams(cfg, seqs, window, args.decode_tokens)
            print(f"vla_quantize: GPTQ {args.weight_dtype} on {streams.frames} frames of {len(seqs)} episodes, KV "
                  f"window {window} frames ({window_from}); four passes per decoder layer", flush=True)
            model = G.calibrate(cfg, tensors, args.weight_dtype, streams, damp=args.damp,
                                progress=lambda line: print(line, flush=True))
            record.update(method="gptq", calibration={
                "bags": [str(b) for b in args.calibrate], "sha256": bag_digest(args.calibrate),
                "episodes": used, "frames": streams.frames, "every": args.every, "window_frames": window,
                "decode_tokens": args.decode_tokens, "damp": args.damp,
                "int4_clip_grid": list(G.INT4_CLIP_GRID) if args.weight_dtype == "int4" else None})
        else:
            model = quantize_weights(tensors, args.weight_dtype)
            record.update(method="round_to_nearest", calibration=None)
    except (EngineError, BagReadError, OSError, ValueError) as exc:  # QuantCheckpointError is an EngineError
        print(f"vla_quantize: {exc}", file=sys.stderr)
        return 2
    write_quantized_checkpoint(dst, cfg_dict, model)
    if (src / "training_record.json").is_file():
        shutil.copy2(src / "training_record.json", dst / "training_record.json")
    errors = [s.rel_frobenius_error for s in model.stats.values()]
    record.update(seconds=round(time.perf_counter() - t0, 1), linear_bytes=model.linear_bytes(),
                  rel_frobenius_error={"mean": float(np.mean(errors)), "max": float(np.max(errors))},
                  per_weight={n: {"rel_frobenius_error": s.rel_frobenius_error, "max_abs_error": s.max_abs_error}
                              for n, s in model.stats.items()})
    (dst / RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"vla_quantize: {len(model.linear)} linear weights as {args.weight_dtype} ({record['method']}), "
          f"{dst / QUANT_FILE}: {(dst / QUANT_FILE).stat().st_size / 2**20:.1f} MiB, {record['seconds']} s; "
          f"load it with checkpoint:={dst} weight_dtype:={args.weight_dtype}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
