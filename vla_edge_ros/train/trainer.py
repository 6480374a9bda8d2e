"""Behaviour cloning into this package's checkpoint format: teacher-forced cross-entropy on the action tokens.

What one run does:
1. reads the bags' episodes (data/bag_reader.py; OXE and sim bags alike), splits them train / held-out by a
   seeded permutation, computes q01/q99 from the training actions (train/dataset.py);
2. builds the checkpoint's config (HF Qwen2 config.json with the ``vla`` block: action names from the bags,
   q01/q99, n_action_bins 256, patch_grid, patch_size; vocabulary = 256 byte tokens + the action bins, as
   engine/config.py requires) and a seeded VLAPolicy (train/model.py);
3. trains with AdamW (linear warm-up, cosine decay, gradient clipping) on batches of runtime contexts, the loss
   the mean cross-entropy over the A + 2 rows (START, the chunk's A = action_horizon * action_dims bins, END;
   train/dataset.py), rows of chunk steps past an episode's end masked out (H > 1 only; H = 1 never pads and
   keeps the plain mean); with ``chunk_decode`` "parallel" over the A bins alone, predicted by A action slots in
   one pass (train/model.py parallel_logits), the same rows masked; the frames live on the training device and a
   batch is gathered there from the dataset's index Rows (DeviceData), so a step is bound by the model, not by
   per-sample Python;
4. evaluates on the held-out episodes every ``eval_every`` steps (teacher-forced loss and action-token accuracy)
   and at the end (also greedy decoding, as the engines decode -- one pass for parallel -- and with the full past
   context); with H > 1 the action figures are over every unpadded chunk step, and ``step0`` repeats them for
   the chunk's first step (the one executed first); train/evaluate.py holds the loss and the figures;
5. writes ``config.json`` + ``model.safetensors`` (engine/checkpoint.write_checkpoint: what load_checkpoint and
   make_engine(checkpoint:=DIR) read), ``loss_curve.png`` and ``training_record.json`` (data hash, seed, the
   command, git commit, the figures, and how to deploy: the retained-frame limit the context was trained for).

Deterministic for a seed on one device and thread count: numpy Generator for the data, a seeded torch
Generator for the init, torch.use_deterministic_algorithms. Runs on CPU by default for a small model, on CUDA
when torch sees a GPU (``device="auto"``).
"""
from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from vla_edge_ros.data.bag_reader import bag_digest, read_bags
from vla_edge_ros.engine import geometry
from vla_edge_ros.engine.checkpoint import load_checkpoint, write_checkpoint
from vla_edge_ros.engine.config import (BYTE_TOKENS, CHUNK_DECODES, DEFAULT_ACTION_NAMES, ModelConfig,
                                        tiny_default_dict)
from vla_edge_ros.train.dataset import START_BIN, ContextSpec, DemoDataset, Rows, end_bin
# the objective and the figures live in train/evaluate.py; re-exported here for the callers that import them here
from vla_edge_ros.train.evaluate import action_figures, batch_loss, evaluate, greedy_bins  # noqa: F401
from vla_edge_ros.train.model import VLAPolicy

N_ACTION_BINS = 256


@dataclass
class TrainConfig:
    bags: list[str]
    out: str
    # model geometry
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 0  # 0 = 2.75 x hidden rounded to 32 (the tiny default's ratio)
    patch_grid: tuple[int, int] = (4, 8)
    patch_size: int = 16
    tie_embeddings: bool = True
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 8192
    init_std: float = 0.02
    # optimisation
    steps: int = 1000
    batch_size: int = 32
    lr: float = 1e-3
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    # data
    context: ContextSpec = field(default_factory=ContextSpec)
    holdout_frac: float = 0.1
    eval_every: int = 100
    eval_samples: int = 1024
    # run
    seed: int = 0
    device: str = "auto"
    threads: int = 0  # 0 = torch's default
    weights_dtype: str = "float32"  # or bfloat16 (half the file; what the CUDA engine uploads anyway)
    # start from this checkpoint's weights instead of a seeded init (a longer run split over several sessions or
    # machines: a second run continues the first with a fresh warm-up and cosine); its config must equal this
    # run's (geometry and the q01 / q99 the bins mean), else it is refused
    init_checkpoint: str = ""
    # H, actions per chunk (config.json vla.action_horizon; train/dataset.py's targets). The tensors do not depend
    # on it, so an init_checkpoint of another H is accepted (H = 1 -> H = 4: a single-step policy continued)
    action_horizon: int = 1
    # vla.chunk_decode: "autoregressive" (targets START, bins, END, teacher forced) or "parallel" (A action
    # slots in one pass, the A bins as targets; train/evaluate.py). The tensors do not depend on it either, so
    # an autoregressive init_checkpoint may start a parallel run
    chunk_decode: str = "autoregressive"
    progress: bool = True
    command: str = ""

    def intermediate_size(self) -> int:
        return self.intermediate or max(32, int(round(self.hidden * 2.75 / 32)) * 32)


def model_config_dict(tc: TrainConfig, q01: Sequence[float], q99: Sequence[float],
                      names: Sequence[str] = DEFAULT_ACTION_NAMES) -> dict[str, Any]:
    """config.json of the checkpoint (engine/config.py reads it back; tiny_default_dict's layout)."""
    d = tiny_default_dict()
    d.update(hidden_size=tc.hidden, num_hidden_layers=tc.layers, num_attention_heads=tc.heads,
             num_key_value_heads=tc.kv_heads, intermediate_size=tc.intermediate_size(),
             vocab_size=BYTE_TOKENS + N_ACTION_BINS, max_position_embeddings=tc.max_position_embeddings,
             rope_theta=tc.rope_theta, tie_word_embeddings=tc.tie_embeddings)
    d["vla"] = {"action_dims": len(names), "action_names": list(names), "action_q01": list(q01),
                "action_q99": list(q99), "n_action_bins": N_ACTION_BINS, "patch_grid": list(tc.patch_grid),
                "patch_size": tc.patch_size, "action_horizon": tc.action_horizon, "chunk_decode": tc.chunk_decode}
    return ModelConfig.from_json(d).to_dict()  # validated, in the canonical form


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device cuda requested but torch sees no CUDA GPU")
    return torch.device(name)


@dataclass
class DeviceBatch:
    """A batch as the model's packed_logits takes it, every tensor on the training device."""
    prefix_ids: torch.Tensor  # (B, Pmax) int64, right-padded
    prefix_lens: torch.Tensor  # (B,)
    frames: torch.Tensor  # (sum F_b, H, W, 3) float32 pixels in [0, 255], shifted
    frame_counts: torch.Tensor  # (B,)
    targets: torch.Tensor  # (B, A + 2) bins: START, the chunk's bins (time-major), END
    target_mask: torch.Tensor  # (B, A + 2) bool: False = padded (a chunk step past the episode's end, its END)
    context_len: int  # max_b P_b + F_b * tokens_per_frame (known on the host: no device sync)

    def __len__(self) -> int:
        return int(self.targets.shape[0])


class DeviceData:
    """The dataset's frames (one uint8 tensor, float16 when resized), action bins and instruction prefixes on
    the training device; ``batch`` turns dataset Rows into a DeviceBatch by index arithmetic -- the shift is a
    clamped row / column index (dataset.shift_index), the gather one advanced index over all frames, the chunk
    targets and their padding mask dataset.chunk_targets' arithmetic -- so the CPU only draws a few hundred
    integers per step and the GPU does the rest."""

    def __init__(self, ds: DemoDataset, device: torch.device, tokens_per_frame: int, seed: int = 0):
        self.ds, self.device, self.tpf = ds, device, int(tokens_per_frame)
        # pixel noise is drawn here, on the device (a numpy draw of B x F x H x W x 3 normals would cost more
        # than the step), from its own seeded generator, so a run stays deterministic for a seed
        self.noise_gen = torch.Generator(device=device).manual_seed(int(seed))
        eps = ds.episodes
        self.offsets, self.lengths = ds.offsets, ds.lengths
        self.pixels = torch.from_numpy(np.concatenate([ep.pixels for ep in eps])).to(device)
        self.bins = torch.from_numpy(ds.all_bins).to(device)  # (sum T, action_dims)
        self.chunk_steps = torch.arange(ds.horizon, device=device)[None, :]  # chunk step j = 0 .. H - 1
        self.prefix_lens = np.array([len(ep.prefix_ids) for ep in eps], np.int64)
        prefix = np.zeros((len(eps), max(1, int(self.prefix_lens.max()))), np.int64)
        for e, ep in enumerate(eps):
            prefix[e, :len(ep.prefix_ids)] = ep.prefix_ids
        self.prefix = torch.from_numpy(prefix).to(device)

    def batch(self, rows: Rows) -> DeviceBatch:
        valid = rows.frames >= 0
        counts = valid.sum(axis=1)
        glob = self.offsets[rows.episodes]
        frames = (glob[:, None] + rows.frames)[valid]  # (sum F_b,) in sample order, oldest -> current
        shifts = np.repeat(rows.shifts, counts, axis=0)  # one shift per sample, for all its frames
        lens = self.prefix_lens[rows.episodes]
        left = self.lengths[rows.episodes] - rows.current  # steps to the episode's end, the current one included
        packed = torch.from_numpy(np.concatenate([frames, shifts[:, 0], shifts[:, 1], rows.episodes,
                                                  glob + rows.current, counts, lens, left])).to(self.device)
        n, b = len(frames), len(rows)
        f, dy, dx, ep, cur, cnt, ln, lf = torch.split(packed, [n, n, n, b, b, b, b, b])
        H, W = self.pixels.shape[1:3]
        ys = (torch.arange(H, device=self.device)[None, :] + dy[:, None]).clamp(0, H - 1)  # shift_index
        xs = (torch.arange(W, device=self.device)[None, :] + dx[:, None]).clamp(0, W - 1)
        px = self.pixels[f[:, None, None], ys[:, :, None], xs[:, None, :]].float()  # (n, H, W, 3)
        px = self._photometric(px, rows, counts)
        # dataset.chunk_targets: step t + j clipped at the episode's last step, valid while j < left
        valid = self.chunk_steps < lf[:, None]  # (b, H)
        src = cur[:, None] + torch.minimum(self.chunk_steps, lf[:, None] - 1)
        col = torch.ones(b, 1, dtype=torch.long, device=self.device)
        targets = torch.cat([START_BIN * col, self.bins[src].reshape(b, -1), end_bin(self.ds.n_bins) * col], 1)
        dims = self.bins.shape[1]
        mask = torch.cat([col.bool(), valid.repeat_interleave(dims, dim=1), valid[:, -1:]], 1)
        return DeviceBatch(self.prefix[ep], ln, px, cnt, targets, mask, int((lens + counts * self.tpf).max()))

    def _photometric(self, px: torch.Tensor, rows: Rows, counts: np.ndarray) -> torch.Tensor:
        """dataset.to_batch's brightness offset (one per sample, all its frames), then the device's pixel noise;
        clipped to the pixel range a camera delivers. Evaluation rows carry neither."""
        noise = self.ds.context.pixel_noise if rows.augmented else 0.0
        if rows.brightness is None and not noise:
            return px
        if rows.brightness is not None:
            off = torch.from_numpy(np.repeat(rows.brightness, counts)).to(self.device)
            px = px + off[:, None, None, None]
        if noise:
            px = px + noise * torch.randn(px.shape, generator=self.noise_gen, device=self.device)
        return px.clamp_(0.0, 255.0)


def _lr_lambda(tc: TrainConfig) -> Callable[[int], float]:
    def f(step: int) -> float:
        if step < tc.warmup_steps:
            return (step + 1) / tc.warmup_steps
        progress = (step - tc.warmup_steps) / max(1, tc.steps - tc.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return f


def _optimizer(policy: VLAPolicy, tc: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for n, p in policy.named_parameters() if p.ndim >= 2 and n != "vision.pos_embed"]
    rest = [p for n, p in policy.named_parameters() if not (p.ndim >= 2 and n != "vision.pos_embed")]
    return torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=tc.lr, betas=(0.9, 0.95))


def git_commit() -> dict[str, Any]:
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30).stdout.strip() != ""
        return {"commit": head, "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def plot_curves(path: Path, losses: Sequence[float], evals: Sequence[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    steps = np.arange(1, len(losses) + 1)
    ax.plot(steps, losses, color="0.75", lw=0.8, label="train (batch)")
    if len(losses) >= 2:
        ema, acc = [], losses[0]
        for v in losses:
            acc = 0.95 * acc + 0.05 * v
            ema.append(acc)
        ax.plot(steps, ema, color="C0", label="train (EMA 0.95)")
    if evals:
        ax.plot([e["step"] for e in evals], [e["loss"] for e in evals], "o-", color="C1", label="held-out")
        ax2.plot([e["step"] for e in evals], [e["action_token_acc"] for e in evals], "o-", label="all dims")
        ax2.plot([e["step"] for e in evals], [e["action_token_acc_varying_dims"] for e in evals], "s-",
                 label="dims that vary")
    ax.set(xlabel="step", ylabel="cross-entropy (action tokens)", yscale="log", title="loss")
    ax2.set(xlabel="step", ylabel="accuracy", ylim=(0, 1), title="held-out action-token accuracy (teacher forced)")
    ax.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def decode_targets(tc: TrainConfig, mcfg: ModelConfig) -> dict[str, Any]:
    """The record's account of what the loss was over (train/evaluate.target_rows)."""
    a = tc.action_horizon * mcfg.action_dims
    if tc.chunk_decode == "parallel":
        return {"chunk_decode": "parallel", "slot_token": geometry.parallel_slot_token(mcfg), "rows": a,
                "action_horizon": tc.action_horizon}
    return {"chunk_decode": "autoregressive", "gen0_bin": START_BIN, "end_bin": end_bin(N_ACTION_BINS),
            "rows": a + 2, "action_horizon": tc.action_horizon}


def _init_tensors(ckpt_dir: str, mcfg: ModelConfig) -> dict[str, np.ndarray]:
    """The tensors of ``ckpt_dir`` for ``init_checkpoint``, refused unless its config equals this run's but for
    vla.action_horizon and vla.chunk_decode (the tensors depend on neither: a single-step checkpoint may start a
    chunk run, an autoregressive one a parallel run)."""
    theirs = ModelConfig.from_json(ckpt_dir).to_dict()
    ours = mcfg.to_dict()
    diff = sorted(k for k in set(theirs) | set(ours) if k != "vla" and theirs.get(k) != ours.get(k))
    tv, ov = theirs.get("vla", {}), ours.get("vla", {})
    free = ("action_horizon", "chunk_decode")
    diff += sorted(f"vla.{k}" for k in set(tv) | set(ov) if k not in free and tv.get(k) != ov.get(k))
    if diff:
        raise ValueError(f"init_checkpoint {ckpt_dir}: its config differs from this run's in {diff} "
                         f"(same geometry, data and action bins are needed to continue a run)")
    return load_checkpoint(ckpt_dir, mcfg)


def train(tc: TrainConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """One training run (module docstring); returns the training record (also written to the output)."""
    if tc.steps < 1 or tc.batch_size < 1:
        raise ValueError(f"steps and batch_size must be >= 1, got {tc.steps} and {tc.batch_size}")
    if isinstance(tc.action_horizon, bool) or not isinstance(tc.action_horizon, int) or tc.action_horizon < 1:
        raise ValueError(f"action_horizon must be an integer >= 1, got {tc.action_horizon!r}")
    if tc.chunk_decode not in CHUNK_DECODES:
        raise ValueError(f"chunk_decode must be one of {', '.join(CHUNK_DECODES)}, got {tc.chunk_decode!r}")
    t_start = time.perf_counter()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    torch.use_deterministic_algorithms(True, warn_only=True)
    if tc.threads:
        torch.set_num_threads(tc.threads)
    torch.manual_seed(tc.seed)
    device = pick_device(tc.device)
    out = Path(tc.out)
    episodes, summaries = read_bags(tc.bags)
    for s in summaries:
        log(s.text())
    image_hw = (tc.patch_grid[0] * tc.patch_size, tc.patch_grid[1] * tc.patch_size)
    ds = DemoDataset(episodes, image_hw, BYTE_TOKENS + N_ACTION_BINS, N_ACTION_BINS, tc.context, tc.holdout_frac,
                     tc.seed, tc.action_horizon)
    cfg_dict = model_config_dict(tc, ds.q01, ds.q99)
    mcfg = ModelConfig.from_json(cfg_dict)
    policy = VLAPolicy(mcfg).init_weights(tc.seed, tc.init_std)
    if tc.init_checkpoint:
        policy.load_tensors(_init_tensors(tc.init_checkpoint, mcfg))
        theirs = ModelConfig.from_json(tc.init_checkpoint)
        log(f"vla_train: weights from {tc.init_checkpoint} (action_horizon {theirs.action_horizon} -> "
            f"{tc.action_horizon}, chunk_decode {theirs.chunk_decode} -> {tc.chunk_decode})")
    policy = policy.to(device)
    n_params = sum(p.numel() for p in policy.parameters())
    info = ds.describe()
    log(f"vla_train: {info['train_episodes']} train / {info['heldout_episodes']} held-out episodes "
        f"({info['train_steps']} / {info['heldout_steps']} steps), {n_params / 1e6:.2f} M parameters, device "
        f"{device}, torch threads {torch.get_num_threads()}")
    opt = _optimizer(policy, tc)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(tc))
    rng = np.random.default_rng(tc.seed)
    data = DeviceData(ds, device, mcfg.n_patches, tc.seed)
    heldout = ds.eval_rows(tc.batch_size, "heldout", tc.eval_samples, tc.seed)
    try:
        from tqdm import tqdm
        bar = tqdm(total=tc.steps, unit="step", desc="vla_train", disable=None if tc.progress else True,
                   file=sys.stderr)
    except ImportError:
        bar = None
    losses: list[float] = []
    evals: list[dict] = []
    step_s: list[float] = []
    policy.train()
    for step in range(1, tc.steps + 1):
        t0 = time.perf_counter()
        loss, _, _ = batch_loss(policy, data.batch(ds.sample_rows(rng, tc.batch_size)))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), tc.grad_clip)
        opt.step()
        sched.step()
        losses.append(loss.item())
        step_s.append(time.perf_counter() - t0)
        if heldout and (step % tc.eval_every == 0 or step == tc.steps):
            evals.append({"step": step, **evaluate(policy, data, heldout)})
            e = evals[-1]
            line = (f"step {step}: train loss {losses[-1]:.4f}, held-out loss {e['loss']:.4f}, action-token acc "
                    f"{e['action_token_acc_varying_dims']:.3f} (varying dims), bin MAE {e['bin_mae_varying_dims']:.1f}, "
                    f"{1e3 * np.mean(step_s[-tc.eval_every:]):.0f} ms/step")
            (bar.write if bar is not None and not bar.disable else log)(line)
        if bar is not None:
            post = {"loss": f"{losses[-1]:.3f}"}
            if evals:
                post["heldout_acc"] = f"{evals[-1]['action_token_acc_varying_dims']:.3f}"
            bar.set_postfix(post, refresh=False)
            bar.update(1)
    if bar is not None:
        bar.close()
    final: dict[str, Any] = {}
    if heldout:
        final["teacher_forced"] = evals[-1]
        final["greedy"] = evaluate(policy, data, heldout, greedy=True)
        full = ds.eval_rows(tc.batch_size, "heldout", tc.eval_samples, tc.seed,
                            past_frames=tc.context.max_past_frames)
        final["greedy_full_context"] = evaluate(policy, data, full, greedy=True)
    out.mkdir(parents=True, exist_ok=True)
    write_checkpoint(out, cfg_dict, policy.export_tensors(), dtype=tc.weights_dtype)
    plot_curves(out / "loss_curve.png", losses, evals)
    timed = step_s[min(5, len(step_s) - 1):]  # the first steps pay one-time costs
    record = {
        "command": tc.command or " ".join(sys.argv), "seed": tc.seed, "git": git_commit(),
        "data": {"bags": [str(b) for b in tc.bags], "sha256": bag_digest(tc.bags),
                 "read": [{"bag": s.bag, "episodes": s.episodes, "steps": s.steps, "image_topic": s.image_topic,
                           "skipped": dict(s.skipped), "notes": s.notes} for s in summaries], **info},
        "model": {"parameters": n_params, "config": cfg_dict, "weights_dtype": tc.weights_dtype},
        "train": {k: v for k, v in asdict(tc).items() if k not in ("bags", "out", "command", "context")},
        "context": {**asdict(tc.context), "decode_targets": decode_targets(tc, mcfg)},
        "deploy": {"max_retained_frames": tc.context.max_past_frames + 1, "eviction_policy": "sliding_window",
                   "window_frames": tc.context.max_past_frames + 1, "tokens_per_frame": mcfg.n_patches,
                   "decode_tokens_min": mcfg.action_dims, "image_hw": list(image_hw),
                   "frame_stride_control_steps": tc.context.frame_stride, "action_horizon": tc.action_horizon,
                   "chunk_decode": tc.chunk_decode,  # the engines' decode passes (parallel: 1, over A slots)
                   "decode_steps": geometry.chunk_decode_steps(mcfg, mcfg.action_dims + 1)},
        "figures": {"steps": tc.steps, "final_train_loss": losses[-1],
                    "train_loss_last_10pct": float(np.mean(losses[-max(1, len(losses) // 10):])),
                    "time_per_step_ms": 1e3 * float(np.mean(timed)), "wall_s": time.perf_counter() - t_start,
                    "heldout": final, "evals": evals},
        "environment": {"torch": torch.__version__, "device": str(device), "threads": torch.get_num_threads(),
                        "python": platform.python_version(), "machine": platform.machine()},
        "losses": losses,
    }
    (out / "training_record.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return record
