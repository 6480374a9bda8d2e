"""H200 run of issue 21: one multi-task policy from the three task bags, steps sized to the time left,
then held-out action-token accuracy per task (teacher-forced and greedy, full past context).

Uses train/trainer.train unchanged (v2: batches gathered on the GPU, trainer.DeviceData); only wraps read_bags (read once, shared by the timing probe and the run) and
captures the DemoDataset / VLAPolicy instances train() builds, to evaluate per task afterwards.
--action-horizon H trains action chunks (vla.action_horizon; the timing probe runs that geometry too); the
per-task figures are then over every unpadded chunk step, ``step0`` the chunk's first step alone (the mode-bin
baseline is step 0's). --chunk-decode parallel trains the A = H x 7 bins as action slots filled in one pass
(trainer chunk_decode; its greedy evaluation is that one pass, so no extra time is reserved for it).
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import torch

import vla_edge_ros.train.trainer as T
from vla_edge_ros.sim.tasks import task_for_instruction
from vla_edge_ros.train.dataset import ContextSpec


def per_task_eval(ds, policy, dev, past, steps=0, step_ms=0.0, deploy=None):
    data = T.DeviceData(ds, dev, policy.cfg.n_patches)
    """Held-out figures per task: teacher-forced / greedy with ``past`` past frames, greedy with none."""
    policy.eval()
    held = ds._steps["heldout"]
    task_of = {i: task_for_instruction(bytes(ds.episodes[i].prefix_ids.astype(np.uint8)).decode()).key
               for i in ds.heldout_idx}
    train_bins = np.concatenate([ds.episodes[i].bins for i in ds.train_idx])
    mode_bins = np.array([np.bincount(train_bins[:, d]).argmax() for d in range(train_bins.shape[1])])
    per_task = {"steps": steps, "probe_ms_per_step": step_ms, "deploy": deploy, "tasks": {}}
    sel_rng = np.random.default_rng(0)
    for task in sorted(set(task_of.values())):
        rows = held[np.array([task_of[int(e)] == task for e, _ in held])]
        if len(rows) > 2048:
            rows = rows[np.sort(sel_rng.choice(len(rows), 2048, replace=False))]
        out = {"heldout_episodes": sum(1 for v in task_of.values() if v == task), "samples": int(len(rows))}
        for mode, greedy, k in (("teacher_forced_full_context", False, past), ("greedy_full_context", True, past),
                                ("greedy_no_past", True, 0)):
            batches = ds.eval_rows(256, max_samples=len(rows), past_frames=k, steps=rows)
            ev = T.evaluate(policy, data, batches, greedy=greedy)
            out[mode] = {k2: ev[k2] for k2 in ("loss", "action_token_acc", "action_token_acc_varying_dims",
                                               "action_token_acc_per_dim", "bin_mae_varying_dims", "action_mae_per_dim",
                                               "step0", "action_token_acc_varying_dims_per_step")}
        tb = np.stack([ds.episodes[int(e)].bins[int(t)] for e, t in rows])
        vary = ds.varying_dims
        out["mode_bin_baseline_acc_varying_dims"] = float((tb[:, vary] == mode_bins[vary]).mean())
        per_task["tasks"][task] = out
        g, tf = out["greedy_full_context"], out["teacher_forced_full_context"]
        per_step = g["action_token_acc_varying_dims_per_step"]
        print(f"  held-out {task:<22} {out['heldout_episodes']:>3} eps {out['samples']:>5} samples: teacher-forced acc "
              f"{tf['action_token_acc_varying_dims']:.3f}, greedy acc {g['action_token_acc_varying_dims']:.3f} "
              f"(varying dims; mode-bin baseline {out['mode_bin_baseline_acc_varying_dims']:.3f}), greedy bin MAE "
              f"{g['bin_mae_varying_dims']:.2f}, action MAE/dim {[round(v, 4) for v in g['action_mae_per_dim']]}"
              + (f"; greedy acc per chunk step {[v if v is None else round(v, 3) for v in per_step]}"
                 if len(per_step) > 1 else ""), flush=True)
    return per_task


def main():
    p = argparse.ArgumentParser()
    p.add_argument("bags", nargs="+")
    p.add_argument("--out", required=True)
    p.add_argument("--deadline", type=float, required=True, help="epoch seconds by which training must be done")
    p.add_argument("--max-steps", type=int, default=3000)
    p.add_argument("--min-steps", type=int, default=1000)
    p.add_argument("--past", type=int, default=1)
    p.add_argument("--per-task-json", required=True)
    p.add_argument("--device", default="cuda", help="cpu: a local smoke run of this script")
    p.add_argument("--init", default="", help="continue from this checkpoint (trainer init_checkpoint)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--action-horizon", type=int, default=1, help="H: actions per chunk (trainer action_horizon)")
    p.add_argument("--chunk-decode", default="autoregressive", choices=("autoregressive", "parallel"),
                   help="vla.chunk_decode (trainer chunk_decode)")
    p.add_argument("--frame-stride", type=int, default=1,
                   help="control steps between retained past frames (synchronous chunks retain one per chunk)")
    p.add_argument("--brightness", type=float, default=0.0, help="ContextSpec.brightness (pixel levels)")
    p.add_argument("--pixel-noise", type=float, default=0.0, help="ContextSpec.pixel_noise (pixel levels)")
    p.add_argument("--geometry", default="h200", choices=("h200", "tiny"), help="tiny: the smoke run's model")
    a = p.parse_args()

    _cache = {}
    _orig_read = T.read_bags


    def cached_read(bags, **kw):
        key = tuple(map(str, bags))
        if key not in _cache:
            t0 = time.time()
            _cache[key] = _orig_read(bags, **kw)
            print(f"[train_eval] read bags in {time.time() - t0:.1f} s", flush=True)
        return _cache[key]


    T.read_bags = cached_read
    captured = {}


    class CapDS(T.DemoDataset):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            captured["ds"] = self


    class CapPolicy(T.VLAPolicy):
        def __init__(self, cfg):
            super().__init__(cfg)
            captured["policy"] = self


    T.DemoDataset, T.VLAPolicy = CapDS, CapPolicy

    ctx = ContextSpec(max_past_frames=a.past, frame_stride=a.frame_stride, past_sampling="recent", subset_window=0,
                      shift_px=4, brightness=a.brightness, pixel_noise=a.pixel_noise)
    tc = T.TrainConfig(bags=a.bags, out=a.out, hidden=256, layers=6, heads=4, kv_heads=2, steps=10, batch_size=256,
                       lr=a.lr, warmup_steps=100, weight_decay=0.01, context=ctx, holdout_frac=0.1, eval_every=250,
                       eval_samples=1024, seed=0, device=a.device, weights_dtype="bfloat16", progress=False,
                       action_horizon=a.action_horizon, chunk_decode=a.chunk_decode)
    if a.geometry == "tiny":
        tc.hidden, tc.layers, tc.batch_size, tc.eval_every = 32, 1, 8, 5

    # ---- timing probe: 15 steps of the real geometry on the real data (first 5 not timed) ----------------------
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    episodes, summaries = cached_read(a.bags)
    image_hw = (tc.patch_grid[0] * tc.patch_size, tc.patch_grid[1] * tc.patch_size)
    ds0 = T.DemoDataset(episodes, image_hw, T.BYTE_TOKENS + T.N_ACTION_BINS, T.N_ACTION_BINS, ctx, tc.holdout_frac, 0,
                        tc.action_horizon)
    mcfg = T.ModelConfig.from_json(T.model_config_dict(tc, ds0.q01, ds0.q99))
    pol = T.VLAPolicy(mcfg).init_weights(0).to(dev)
    opt = torch.optim.AdamW(pol.parameters(), lr=1e-4)
    rng = np.random.default_rng(123)
    data0 = T.DeviceData(ds0, dev, mcfg.n_patches)
    times = []
    for i in range(15):
        sync()
        t0 = time.perf_counter()
        loss, _, _ = T.batch_loss(pol, data0.batch(ds0.sample_rows(rng, tc.batch_size)))
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss.item()
        times.append(time.perf_counter() - t0)
    step_s = float(np.mean(times[5:]))
    reserve = 30.0  # final evals + writing (H = 1: the v3 / v4 recipe's figure)
    if tc.action_horizon > 1 and tc.chunk_decode == "autoregressive":  # greedy evals cost A + 2 passes a batch
        pol.eval()
        b = data0.batch(ds0.eval_rows(256, max_samples=256)[0])
        sync()
        t0 = time.perf_counter()
        T.greedy_bins(pol, b)
        sync()
        greedy_s = time.perf_counter() - t0
        held = ds0._steps["heldout"]
        per_prefix = {}
        for e, _ in held:
            key = bytes(ds0.episodes[int(e)].prefix_ids.astype(np.uint8))
            per_prefix[key] = per_prefix.get(key, 0) + 1
        batches = 2 * -(-min(tc.eval_samples, len(held)) // 256) + 2 * sum(-(-min(2048, n) // 256)
                                                                          for n in per_prefix.values())
        reserve = max(reserve, 15.0 + 1.1 * greedy_s * batches)
        print(f"[train_eval] greedy eval {1e3 * greedy_s:.0f} ms per batch of 256, {batches} batches: "
              f"{reserve:.0f} s reserved after training", flush=True)
    del pol, opt, ds0, data0
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    budget = a.deadline - time.time() - reserve
    steps = int(max(a.min_steps, min(a.max_steps, budget / (1.1 * step_s))))
    steps = steps // 50 * 50
    print(f"[train_eval] probe {1e3 * step_s:.1f} ms/step; {budget:.0f} s for training -> {steps} steps", flush=True)
    tc.steps = steps
    tc.init_checkpoint = a.init
    tc.warmup_steps = 100
    tc.command = "tools/train_policy/train_eval.py " + " ".join(sys.argv[1:]) + f"  (TrainConfig steps={steps})"
    t0 = time.time()
    record = T.train(tc)
    f = record["figures"]
    print(f"[train_eval] trained {steps} steps in {time.time() - t0:.1f} s ({f['time_per_step_ms']:.1f} ms/step), "
          f"final train loss {f['final_train_loss']:.4f}", flush=True)
    for name, e in f["heldout"].items():
        print(f"  held-out(all) {name:<20} loss {e['loss']:.4f} acc {e['action_token_acc']:.3f} "
              f"(varying {e['action_token_acc_varying_dims']:.3f}) bin MAE {e['bin_mae_varying_dims']:.2f}", flush=True)
    print("[train_eval] deploy block:", json.dumps(record["deploy"]), flush=True)

    per_task = per_task_eval(captured["ds"], captured["policy"], dev, a.past, steps, 1e3 * step_s, record["deploy"])
    with open(a.per_task_json, "w") as fh:
        json.dump(per_task, fh, indent=2)



if __name__ == "__main__":
    main()
