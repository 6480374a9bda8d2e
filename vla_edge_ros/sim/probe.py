"""``python -m vla_edge_ros.sim.probe``: what the simulator costs and whether its experts solve it, here.

Prints (and with ``--json FILE`` writes):
- env step and reset time per task;
- render time of the fixed camera at 64 / 96 / 128 px (shadows and reflections off; 96 px with them, for
  reference) -- the figure that decides the CPU default of ``camera_hz`` and the image size;
- camera informativeness: for each camera, the pixels of the gripper, the task object and the goal marker in
  segmentation renders along expert episodes, and the share of frames where all of them are visible;
- the scripted expert's success over N seeds per task, through the 7-dim -> 4-dim path (expert.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import mujoco
import numpy as np

from vla_edge_ros.sim.expert import ScriptedExpert, run_expert_episode
from vla_edge_ros.sim.metaworld_env import CAMERAS, MetaWorldSim
from vla_edge_ros.sim.tasks import TASK_KEYS

GRIPPER_BODIES = ("hand", "rightclaw", "rightpad", "leftclaw", "leftpad")
OBJECT_BODIES = {"reach": ("obj",), "push": ("obj",), "pick-place": ("obj",), "drawer-close": ("drawer_link",),
                 "button-press-topdown": ("button",)}


def _ms(fn, n: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e3


def timing(task: str, reps: int) -> dict[str, Any]:
    sim = MetaWorldSim(task, horizon=10 ** 6)
    sim.reset(0)
    zero = np.zeros(4)
    out: dict[str, Any] = {"step_ms": _ms(lambda: sim.step_env(zero), reps * 10),
                           "reset_ms": _ms(lambda: sim.reset(1), max(3, reps // 4))}
    sim.close()
    for px, shadows in ((64, False), (96, False), (128, False), (96, True)):
        s = MetaWorldSim(task, width=px, height=px, shadows=shadows)
        s.reset(0)
        out[f"render_{px}{'_shadows' if shadows else ''}_ms"] = _ms(s.render, reps)
        s.close()
    return out


def _geoms_of(model, bodies) -> np.ndarray:
    ids = [model.body(b).id for b in bodies]
    return np.flatnonzero(np.isin(model.geom_bodyid, ids))


def visibility(task: str, px: int, seeds: range, every: int = 10) -> dict[str, dict[str, float]]:
    """Per camera: mean pixels of gripper / object / goal marker and the share of frames showing all of them."""
    sim = MetaWorldSim(task)
    model = sim.env.model
    groups = {"gripper": _geoms_of(model, GRIPPER_BODIES), "object": _geoms_of(model, OBJECT_BODIES[task])}
    goal_site = model.site("goal").id if sim.spec.goal_marker else None
    seg = mujoco.Renderer(model, px, px)
    seg.enable_segmentation_rendering()
    counts: dict[str, list[dict[str, int]]] = {c: [] for c in CAMERAS}

    def look(s: MetaWorldSim, _a7) -> None:
        if s.steps % every:
            return
        for cam in CAMERAS:
            seg.update_scene(s.env.data, camera=cam)
            img = seg.render()
            ids, types = img[..., 0], img[..., 1]
            geom = types == mujoco.mjtObj.mjOBJ_GEOM
            c = {k: int(np.sum(geom & np.isin(ids, g))) for k, g in groups.items()}
            if goal_site is not None:
                c["goal"] = int(np.sum((types == mujoco.mjtObj.mjOBJ_SITE) & (ids == goal_site)))
            counts[cam].append(c)

    for seed in seeds:
        run_expert_episode(sim, seed, on_step=look)
    seg.close()
    sim.close()
    out = {}
    for cam, frames in counts.items():
        keys = frames[0].keys()
        out[cam] = {**{f"{k}_px": statistics.fmean(f[k] for f in frames) for k in keys},
                    "all_visible": statistics.fmean(all(f[k] > 0 for k in keys) for f in frames)}
    return out


def expert_success(task: str, seeds: range, horizon: int) -> dict[str, Any]:
    sim = MetaWorldSim(task, horizon=horizon)
    ScriptedExpert(sim)  # fails early if the task has no expert
    results = [run_expert_episode(sim, s) for s in seeds]
    sim.close()
    steps = [r.steps for r in results if r.success]
    return {"successes": sum(r.success for r in results), "episodes": len(results),
            "steps_median": statistics.median(steps) if steps else None, "steps_max": max(steps, default=None),
            "saturated_share": sum(r.saturated for r in results) / max(1, sum(r.steps for r in results))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vla_edge_ros.sim.probe", description=__doc__.split("\n")[0])
    ap.add_argument("--tasks", nargs="*", default=list(TASK_KEYS), choices=TASK_KEYS)
    ap.add_argument("--seeds", type=int, default=10, help="expert episodes per task")
    ap.add_argument("--horizon", type=int, default=500, help="expert episode limit (MetaWorld's own: 500)")
    ap.add_argument("--reps", type=int, default=20, help="timing repetitions")
    ap.add_argument("--visibility-seeds", type=int, default=3, help="expert episodes per task for the camera table")
    ap.add_argument("--visibility-px", type=int, default=96)
    ap.add_argument("--json", default=None, help="also write the figures here")
    opts = ap.parse_args(argv)
    report: dict[str, Any] = {"mujoco": mujoco.__version__, "tasks": {}}
    for task in opts.tasks:
        r = {"timing": timing(task, opts.reps),
             "expert": expert_success(task, range(opts.seeds), opts.horizon)}
        if opts.visibility_seeds:
            r["cameras"] = visibility(task, opts.visibility_px, range(opts.visibility_seeds))
        report["tasks"][task] = r
        t, e = r["timing"], r["expert"]
        print(f"{task}: step {t['step_ms']:.2f} ms, reset {t['reset_ms']:.1f} ms, render 64/96/128 px "
              f"{t['render_64_ms']:.1f}/{t['render_96_ms']:.1f}/{t['render_128_ms']:.1f} ms "
              f"(96 px with shadows {t['render_96_shadows_ms']:.1f} ms); expert {e['successes']}/{e['episodes']} "
              f"median {e['steps_median']} max {e['steps_max']} steps", flush=True)
        for cam, v in r.get("cameras", {}).items():
            px = " ".join(f"{k[:-3]} {val:.0f}" for k, val in v.items() if k.endswith("_px"))
            print(f"    camera {cam:13s} all visible {v['all_visible']:.0%}  mean px: {px}")
    if opts.json:
        with open(opts.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
