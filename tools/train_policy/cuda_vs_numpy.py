"""The CUDA engine on a trained checkpoint against the numpy engine (issue 21: "the CUDA engine loads the trained
checkpoint"): both run the frames of render_probe.py's trajectories as the runtime would (the same instruction,
sliding window of 2 frames, one chunk per frame, the KV cache reset per trajectory) and the action bins are
compared step by step (every step of a chunk). A checkpoint with a deploy block (training_record.json) runs as
closed_loop.py runs it (its tokens per frame, eviction and window); a chunk policy's bins are also compared per
chunk step, and the disagreeing bins say how far apart they are.

    python3 tools/train_policy/cuda_vs_numpy.py metaworld_mt3 FRAMES.npz [--json OUT]
"""
import argparse
import json
import os
import sys

import numpy as np

from vla_edge_ros.engine.factory import make_engine
from vla_edge_ros.sim.tasks import task_spec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # closed_loop.py: how a deploy block runs
from closed_loop import load_deploy, make_policy_engine  # noqa: E402


def run(backend: str, checkpoint: str, frames) -> dict:
    out = {}
    deploy = load_deploy(checkpoint)
    for key in sorted(frames.files):
        task = key.rsplit("_", 1)[0]
        if deploy:
            eng = make_policy_engine(checkpoint, deploy, backend, task_spec(task).instruction)
        else:
            eng = make_engine({"backend": backend, "checkpoint": checkpoint, "instruction": task_spec(task).instruction,
                               "eviction_policy": "sliding_window", "window_frames": 2}, log=lambda *_: None)
        try:
            out[key] = np.stack([np.asarray(eng.run_chunk(eng.encode_frame(img), i).chunk_bins).ravel()
                                for i, img in enumerate(frames[key])])  # (frames, H * action_dims) bins
        finally:
            eng.close()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint")
    p.add_argument("frames")
    p.add_argument("--json", default="")
    p.add_argument("--action-dims", type=int, default=7)
    p.add_argument("--backend", default="cuda", help="the engine compared with numpy (numpy: a self-check)")
    a = p.parse_args(argv)
    frames = np.load(a.frames)
    ref = run("numpy", a.checkpoint, frames)
    got = run(a.backend, a.checkpoint, frames)
    rows = {}
    for key in ref:
        same = ref[key] == got[key]
        rows[key] = {"chunks": int(same.shape[0]), "tokens_equal": float(same.mean()),
                     "chunks_all_equal": int(same.all(axis=1).sum())}
        print(f"{key:<28} token agreement {same.mean():.3f}, chunks identical {same.all(axis=1).sum()}/{same.shape[0]}")
    total = np.concatenate([(ref[k] == got[k]).ravel() for k in ref])
    print(f"all: token agreement cuda vs numpy {total.mean():.4f} over {total.size} tokens")
    a_ref, a_got = np.concatenate([ref[k] for k in ref]), np.concatenate([got[k] for k in ref])
    diff = np.abs(a_ref.astype(np.int64) - a_got.astype(np.int64))[a_ref != a_got]
    if diff.size:
        print(f"disagreeing bins: {diff.size}, |bin difference| median {np.median(diff):.0f}, "
              f"<= 1: {(diff <= 1).mean():.1%}, max {diff.max()}")
    dims = int(a.action_dims)
    per_step = []
    if a_ref.shape[1] % dims == 0 and a_ref.shape[1] > dims:  # a chunk: agreement per chunk step
        same = (a_ref == a_got).reshape(len(a_ref), -1, dims)
        per_step = [float(x) for x in same.mean(axis=(0, 2))]
        print("per chunk step: " + ", ".join(f"{k}: {x:.3f}" for k, x in enumerate(per_step)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "token_agreement": float(total.mean()), "per_chunk_step": per_step,
                       "disagreeing": int(diff.size)}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
