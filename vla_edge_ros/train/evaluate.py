"""The training objective and the held-out figures, for both chunk decodes (moved out of train/trainer.py).

Why one module for the loss and the figures: they must agree on which rows of a batch are the chunk. The
dataset's targets are always the autoregressive layout [START, A = action_horizon * action_dims bins, END]
(train/dataset.py) with its padding mask; ``target_rows`` says what a checkpoint's ``vla.chunk_decode`` trains
on:
- "autoregressive": all A + 2 rows, teacher forced (decode input i is target i, the model predicts target i + 1);
- "parallel": the A bins alone (no START, no END: the slots are not a sequence, train/model.py
  parallel_logits), their mask the same (a chunk step past the episode's end is out of the loss).
Teacher forcing and greedy decoding are one and the same pass for "parallel" (no slot reads another's choice);
for "autoregressive" greedy decoding feeds the model's own choices back (A + 2 passes, evaluation only).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from vla_edge_ros.engine.geometry import is_parallel
from vla_edge_ros.train.model import VLAPolicy


def target_rows(cfg, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets, mask) the loss is over: the batch's A + 2 rows (autoregressive) or its A bins (parallel)."""
    rows = cfg.action_horizon * cfg.action_dims + 2
    if batch.targets.shape[1] != rows:
        raise ValueError(f"batch targets have {batch.targets.shape[1]} rows, the model's chunk {rows} (action_horizon "
                         f"{cfg.action_horizon} x {cfg.action_dims} + START + END): dataset and model disagree on H")
    if is_parallel(cfg):
        return batch.targets[:, 1:-1], batch.target_mask[:, 1:-1]
    return batch.targets, batch.target_mask


def first_bin_row(cfg) -> int:
    """Index of the chunk's first bin in target_rows: after START (autoregressive), 0 (parallel)."""
    return 0 if is_parallel(cfg) else 1


def batch_loss(policy: VLAPolicy, batch):
    """Cross-entropy over target_rows -> (loss, logits, targets). Autoregressive H = 1: the plain mean (nothing
    is padded; the seed's loss, bit for bit); otherwise the mean over the unmasked rows."""
    cfg = policy.cfg
    targets, mask = target_rows(cfg, batch)
    if is_parallel(cfg):
        logits = policy.parallel_logits(batch.prefix_ids, batch.prefix_lens, batch.frames, batch.frame_counts,
                                        batch.context_len)
    else:
        logits = policy.packed_logits(batch.prefix_ids, batch.prefix_lens, batch.frames, batch.frame_counts,
                                      targets[:, :-1] + cfg.action_token_offset, batch.context_len)
    flat = logits.reshape(-1, logits.shape[-1])
    if cfg.action_horizon == 1 and not is_parallel(cfg):
        return F.cross_entropy(flat, targets.reshape(-1)), logits, targets
    weight = mask.reshape(-1).to(flat.dtype)
    ce = F.cross_entropy(flat, targets.reshape(-1), reduction="none")
    return (ce * weight).sum() / weight.sum().clamp(min=1.0), logits, targets


@torch.no_grad()
def greedy_bins(policy: VLAPolicy, batch) -> np.ndarray:
    """The chunk decoded as the engines decode it, as bins in target_rows' layout. Autoregressive: gen[0..A + 1],
    each input the model's own previous choice, one full pass per row (A + 2 passes: evaluation only). Parallel:
    one pass, the argmax of every slot (B, A)."""
    cfg = policy.cfg
    if is_parallel(cfg):
        return policy.parallel_logits(batch.prefix_ids, batch.prefix_lens, batch.frames, batch.frame_counts,
                                      batch.context_len).argmax(-1).cpu().numpy()
    off = cfg.action_token_offset
    targets = batch.targets
    gen_in = torch.zeros_like(targets[:, :-1])
    picked = torch.zeros_like(targets)
    for i in range(targets.shape[1]):
        row = policy.packed_logits(batch.prefix_ids, batch.prefix_lens, batch.frames, batch.frame_counts, gen_in,
                                   batch.context_len)[:, i].argmax(-1)
        picked[:, i] = row
        if i < gen_in.shape[1]:
            gen_in[:, i] = row + off
    return picked.cpu().numpy()


def action_figures(pa: np.ndarray, ta: np.ndarray, vary: Sequence[int], tok) -> dict[str, Any]:
    """Predicted vs target bins (M, action_dims): token accuracy (all / varying dims / per dim), mean |bin error|
    (varying dims) and mean |action error| per dimension (un-normalised units)."""
    act_err = np.abs(tok.bins_to_action(pa) - tok.bins_to_action(ta))
    return {"action_token_acc": float((pa == ta).mean()),
            "action_token_acc_varying_dims": float((pa[:, vary] == ta[:, vary]).mean()),
            "action_token_acc_per_dim": [float(v) for v in (pa == ta).mean(axis=0)],
            "bin_mae_varying_dims": float(np.abs(pa - ta)[:, vary].mean()),
            "action_mae_per_dim": [float(v) for v in act_err.mean(axis=0)]}


@torch.no_grad()
def evaluate(policy: VLAPolicy, data, batches: Sequence, greedy: bool = False) -> dict[str, Any]:
    """Held-out figures over ``batches`` (dataset Rows, gathered by ``data``: trainer.DeviceData): loss (mean
    over the unmasked target rows), action_figures over every unpadded chunk step (H = 1: the one action),
    START / END accuracy (autoregressive only: samples whose END is not padding; None for parallel), and for the
    chunk's first step alone (``step0``, the one executed first) and per step (``..._per_step``)."""
    if not batches:
        return {}
    was_training = policy.training
    policy.eval()
    cfg = policy.cfg
    H, dims, parallel = cfg.action_horizon, cfg.action_dims, is_parallel(cfg)
    losses, preds, targets, masks = [], [], [], []
    ds = data.ds
    for rows in batches:
        b = data.batch(rows)
        loss, logits, tgt = batch_loss(policy, b)
        m = target_rows(cfg, b)[1].cpu().numpy()
        losses.append((float(loss), int(m.sum())))
        # parallel: the teacher-forced pass is the greedy one (no slot reads another's choice)
        preds.append(greedy_bins(policy, b) if greedy and not parallel else logits.argmax(-1).cpu().numpy())
        targets.append(tgt.cpu().numpy())
        masks.append(m)
    policy.train(was_training)
    p, t, m = np.concatenate(preds), np.concatenate(targets), np.concatenate(masks)
    N, first = len(t), first_bin_row(cfg)
    chunk = slice(first, first + H * dims)
    pa, ta = p[:, chunk].reshape(N, H, dims), t[:, chunk].reshape(N, H, dims)
    valid = m[:, chunk].reshape(N, H, dims)[:, :, 0]  # (N, H): chunk step inside the episode
    vary = ds.varying_dims or list(range(dims))
    tok = ds.tokenizer
    start_end_acc = None
    if not parallel:
        end_ok = m[:, -1]
        start_end = (p[:, 0] == t[:, 0]) & (p[:, -1] == t[:, -1])
        start_end_acc = float(start_end[end_ok].mean()) if end_ok.any() else None
    per_step = [action_figures(pa[valid[:, j], j], ta[valid[:, j], j], vary, tok) if valid[:, j].any() else None
                for j in range(H)]
    return {"samples": int(N), "loss": sum(v * n for v, n in losses) / max(1, sum(n for _, n in losses)),
            **action_figures(pa[valid], ta[valid], vary, tok),
            "start_end_acc": start_end_acc, "chunk_decode": cfg.chunk_decode,
            "action_horizon": H, "padded_steps": int((~valid).sum()),
            "step0": per_step[0],
            "action_token_acc_varying_dims_per_step": [None if f is None else f["action_token_acc_varying_dims"]
                                                       for f in per_step],
            "bin_mae_varying_dims_per_step": [None if f is None else f["bin_mae_varying_dims"] for f in per_step]}
