"""`vla_train`: behaviour cloning of a checkpoint from bags (train/trainer.py says what a run does).

    vla_train BAG [BAG ...] --out DIR [--steps 1000] [--batch-size 32] [--hidden 128 --layers 4 --heads 4]
              [--max-past-frames 3] [--frame-stride 1] [--action-horizon 1] [--chunk-decode autoregressive]
              [--seed 0] [--device auto|cpu|cuda]

DIR receives config.json + model.safetensors (load it with ``checkpoint:=DIR``), loss_curve.png and
training_record.json. Deploy with at most ``max_past_frames + 1`` retained frames (the record's ``deploy``
block) and the image size and camera the demonstrations were recorded with. ``--action-horizon H`` trains
action chunks: H actions of consecutive control steps per chunk (config.json vla.action_horizon;
train/dataset.py), an H = 1 checkpoint may seed it through ``--init-checkpoint``. ``--chunk-decode parallel``
trains the chunk's A = H x action_dims bins as action slots filled in one pass (config.json vla.chunk_decode;
train/model.py parallel_logits); an autoregressive checkpoint may seed it too.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from typing import Optional, Sequence

from vla_edge_ros.data.bag_reader import BagReadError


def build_parser() -> argparse.ArgumentParser:
    from vla_edge_ros.engine.config import CHUNK_DECODES
    from vla_edge_ros.train.dataset import PAST_SAMPLING

    p = argparse.ArgumentParser(prog="vla_train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bags", nargs="+", help="rosbag2 bags (vla_sim_demos or oxe_to_bag output)")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    m = p.add_argument_group("model")
    m.add_argument("--hidden", type=int, default=128)
    m.add_argument("--layers", type=int, default=4)
    m.add_argument("--heads", type=int, default=4)
    m.add_argument("--kv-heads", type=int, default=2)
    m.add_argument("--intermediate", type=int, default=0, help="MLP width (0 = 2.75 x hidden)")
    m.add_argument("--patch-grid", type=int, nargs=2, default=[4, 8], metavar=("ROWS", "COLS"))
    m.add_argument("--patch-size", type=int, default=16)
    m.add_argument("--untied", action="store_true", help="a separate lm_head.weight (default: tied embedding)")
    m.add_argument("--weights-dtype", choices=("float32", "bfloat16"), default="float32")
    m.add_argument("--action-horizon", type=int, default=1,
                   help="H: actions per chunk, one per control step (vla.action_horizon; 1 = single step)")
    m.add_argument("--chunk-decode", choices=CHUNK_DECODES, default="autoregressive",
                   help="vla.chunk_decode: one greedy step per action token, or all A slots in one pass")
    o = p.add_argument_group("optimisation")
    o.add_argument("--steps", type=int, default=1000)
    o.add_argument("--batch-size", type=int, default=32)
    o.add_argument("--lr", type=float, default=1e-3)
    o.add_argument("--warmup-steps", type=int, default=50)
    o.add_argument("--weight-decay", type=float, default=0.01)
    d = p.add_argument_group("context (train/dataset.py)")
    d.add_argument("--max-past-frames", type=int, default=3, help="k past frames, k uniform in [0, this]")
    d.add_argument("--frame-stride", type=int, default=1, help="control steps between retained frames")
    d.add_argument("--past-sampling", choices=PAST_SAMPLING, default="recent")
    d.add_argument("--subset-window", type=int, default=0)
    d.add_argument("--shift-px", type=int, default=4, help="random image shift (augmentation)")
    d.add_argument("--brightness", type=float, default=0.0,
                   help="random brightness offset per sample, in pixel levels (augmentation)")
    d.add_argument("--pixel-noise", type=float, default=0.0,
                   help="std of Gaussian pixel noise, in pixel levels (augmentation)")
    d.add_argument("--holdout-frac", type=float, default=0.1)
    d.add_argument("--eval-every", type=int, default=100)
    d.add_argument("--eval-samples", type=int, default=1024)
    r = p.add_argument_group("run")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--device", default="auto", help="auto (cuda when torch sees one), cpu, cuda")
    r.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    r.add_argument("--no-progress", action="store_true")
    r.add_argument("--init-checkpoint", default="",
                   help="continue from this checkpoint's weights (same config; its action_horizon and "
                        "chunk_decode may differ)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    from vla_edge_ros.train.dataset import ContextSpec
    from vla_edge_ros.train.trainer import TrainConfig, train

    try:
        ctx = ContextSpec(a.max_past_frames, a.frame_stride, a.past_sampling, a.subset_window, a.shift_px,
                          a.brightness, a.pixel_noise)
        tc = TrainConfig(bags=a.bags, out=a.out, hidden=a.hidden, layers=a.layers, heads=a.heads,
                         kv_heads=a.kv_heads, intermediate=a.intermediate, patch_grid=tuple(a.patch_grid),
                         patch_size=a.patch_size, tie_embeddings=not a.untied, steps=a.steps,
                         batch_size=a.batch_size, lr=a.lr, warmup_steps=a.warmup_steps,
                         weight_decay=a.weight_decay, context=ctx, holdout_frac=a.holdout_frac,
                         eval_every=a.eval_every, eval_samples=a.eval_samples, seed=a.seed, device=a.device,
                         threads=a.threads, weights_dtype=a.weights_dtype, progress=not a.no_progress,
                         init_checkpoint=a.init_checkpoint, action_horizon=a.action_horizon,
                         chunk_decode=a.chunk_decode,
                         command=shlex.join(["vla_train", *argv]))
        record = train(tc)
    except (ValueError, BagReadError, FileNotFoundError) as exc:
        print(f"vla_train: error: {exc}", file=sys.stderr)
        return 2
    f = record["figures"]
    held = f["heldout"]
    print(f"vla_train: wrote {a.out} ({record['model']['parameters'] / 1e6:.2f} M parameters); {f['steps']} steps, "
          f"{f['time_per_step_ms']:.0f} ms/step, final train loss {f['final_train_loss']:.4f}")
    for name, e in held.items():
        print(f"  held-out {name:<20} loss {e['loss']:.4f}  action-token acc {e['action_token_acc']:.3f} "
              f"(varying dims {e['action_token_acc_varying_dims']:.3f}), bin MAE {e['bin_mae_varying_dims']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
