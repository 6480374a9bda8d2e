"""Renders the same scene states on this machine's GL, to compare renderers (issue 21).

The policy is trained on the H200 machine's NVIDIA EGL renders and evaluated on the CPU machine's Mesa
renders; the same seeds fail differently on the two. This writes, for seeds 0..N-1 of each task, the expert's
trajectory frames at the demonstrations' camera and size, so the two machines' images of identical states can
be diffed:  ``python tools/train_policy/render_probe.py OUT.npz``  then ``--compare A.npz B.npz``.
"""
import argparse
import sys

import numpy as np


def render(out: str, tasks, seeds: int, steps: int, every: int) -> None:
    from vla_edge_ros.sim.expert import ScriptedExpert
    from vla_edge_ros.sim.metaworld_env import MetaWorldSim
    frames = {}
    for task in tasks:
        sim = MetaWorldSim(task, width=128, height=64)
        expert = ScriptedExpert(sim)
        for seed in range(seeds):
            sim.reset(seed)
            imgs = []
            for t in range(steps):
                if t % every == 0:
                    imgs.append(sim.render())
                sim.step_env(expert.env_action())
            frames[f"{task}_{seed}"] = np.stack(imgs)
        sim.close()
    np.savez_compressed(out, **frames)
    print(f"wrote {out}: {len(frames)} trajectories, {sum(len(v) for v in frames.values())} frames")


def compare(a_path: str, b_path: str) -> None:
    a, b = np.load(a_path), np.load(b_path)
    diffs = []
    for k in sorted(set(a.files) & set(b.files)):
        d = a[k].astype(np.int16) - b[k].astype(np.int16)
        diffs.append(d)
        print(f"{k:<28} mean |d| {np.abs(d).mean():6.3f}  max {np.abs(d).max():3d}  pixels differing "
              f"{(np.abs(d).max(-1) > 0).mean():6.1%}  >8: {(np.abs(d).max(-1) > 8).mean():6.1%}  "
              f"mean d per channel {d.reshape(-1, 3).mean(0).round(2).tolist()}")
    d = np.concatenate([x.reshape(-1, 3) for x in diffs])
    print(f"all: mean |d| {np.abs(d).mean():.3f}, mean d per channel {d.mean(0).round(3).tolist()}, "
          f"std {d.std(0).round(3).tolist()}, |d| p99 {np.percentile(np.abs(d), 99):.1f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out", nargs="?")
    p.add_argument("--compare", nargs=2)
    p.add_argument("--tasks", nargs="+", default=["push", "button-press-topdown", "drawer-close"])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=5)
    a = p.parse_args(argv)
    if a.compare:
        compare(*a.compare)
    elif a.out:
        render(a.out, a.tasks, a.seeds, a.steps, a.every)
    else:
        p.error("OUT or --compare A B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
