"""The CUDA engine on a trained checkpoint against the numpy engine (issue 21: "the CUDA engine loads the trained
checkpoint"): both run the frames of render_probe.py's trajectories as the runtime would (the same instruction,
sliding window of 2 frames, one chunk per frame, the KV cache reset per trajectory) and the action bins are
compared step by step.

    python3 tools/train_policy/cuda_vs_numpy.py metaworld_mt3 FRAMES.npz [--json OUT]
"""
import argparse
import json
import sys

import numpy as np

from vla_edge_ros.engine.factory import make_engine
from vla_edge_ros.sim.tasks import task_spec


def run(backend: str, checkpoint: str, frames) -> dict:
    out = {}
    for key in sorted(frames.files):
        task = key.rsplit("_", 1)[0]
        eng = make_engine({"backend": backend, "checkpoint": checkpoint, "instruction": task_spec(task).instruction,
                           "eviction_policy": "sliding_window", "window_frames": 2}, log=lambda *_: None)
        try:
            out[key] = np.stack([eng.run_chunk(eng.encode_frame(img), i).token_ids for i, img in enumerate(frames[key])])
        finally:
            eng.close()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint")
    p.add_argument("frames")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    frames = np.load(a.frames)
    ref, got = run("numpy", a.checkpoint, frames), run("cuda", a.checkpoint, frames)
    rows = {}
    for key in ref:
        same = ref[key] == got[key]
        rows[key] = {"chunks": int(same.shape[0]), "tokens_equal": float(same.mean()),
                     "chunks_all_equal": int(same.all(axis=1).sum())}
        print(f"{key:<28} token agreement {same.mean():.3f}, chunks identical {same.all(axis=1).sum()}/{same.shape[0]}")
    total = np.concatenate([(ref[k] == got[k]).ravel() for k in ref])
    print(f"all: token agreement cuda vs numpy {total.mean():.4f} over {total.size} tokens")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "token_agreement": float(total.mean())}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
