"""Synchronous closed loop without ROS: MetaWorldSim + the numpy engine (make_engine, checkpoint:=DIR), one chunk
per control step, as the runtime steps it: render the camera image (same camera / size as the demos), encode,
run_chunk (KV eviction as the deploy block says), offer the action as 'fresh' to the SimController, one control
step. Held-out seeds 0.. (demos used 1 000 000 ..). Episodes run in spawned worker processes.

Differences from the ROS loop: no timing (every step gets the chunk of the frame rendered just before it).
KV between episodes: with --carry-kv (v2's default) the engine is NOT reset between the episodes a worker runs
and frame ids keep counting, as the runtime does, so with window 2 an episode's first chunk also sees the last
frame of the previous episode of the same task that worker ran (no previous frame for a worker's first episode
of a task); --reset-kv resets the engine at each episode start instead (v1's behaviour).
"""
import argparse
import json
import multiprocessing
import os
import sys
import time

import numpy as np

_CACHE = {}


def _episode(job):
    task, seed, ckpt, deploy, carry_kv = job
    import vla_edge_ros.sim  # noqa: F401  MUJOCO_GL before mujoco
    from vla_edge_ros.engine.factory import make_engine
    from vla_edge_ros.sim.episode import SimController
    from vla_edge_ros.sim.metaworld_env import MetaWorldSim

    if task not in _CACHE:
        h, w = deploy["image_hw"]
        sim = MetaWorldSim(task, "corner", w, h, 200)
        eng = make_engine({"checkpoint": ckpt, "backend": "numpy", "instruction": sim.instruction,
                           "tokens_per_frame": deploy["tokens_per_frame"], "decode_tokens": 8,
                           "eviction_policy": deploy["eviction_policy"], "window_frames": deploy["window_frames"]},
                          log=lambda s: None)
        _CACHE[task] = [sim, eng, 0]
    sim, eng, fid = _CACHE[task]
    carried = len(eng.kv.frames) if carry_kv else 0
    if not carry_kv:
        eng.reset()
    t0 = time.perf_counter()
    ctl = SimController(sim, seed_start=seed, num_episodes=1, action_timeout_ms=1e9)
    chunk_ms = []
    grasp, obj_to_target, near = 0.0, float("inf"), 0.0  # push diagnostics from MetaWorld's info dict
    while True:
        img = sim.render()
        r = eng.run_chunk(eng.encode_frame(img), fid)
        fid += 1
        _CACHE[task][2] = fid
        chunk_ms.append(r.total_ms)
        reason = ctl.offer("fresh", r.action, eng.action_names)
        if reason is not None:
            raise RuntimeError(f"action rejected: {reason} {ctl.last_rejection}")
        res = ctl.control_step()
        info = sim.last_info or {}
        grasp = max(grasp, float(info.get("grasp_success", 0.0)))
        near = max(near, float(info.get("near_object", 0.0)))
        obj_to_target = min(obj_to_target, float(info.get("obj_to_target", float("inf"))))
        if res is not None:
            return {"task": task, "seed": seed, "success": bool(res.success), "steps": res.steps,
                    "saturated": res.saturated, "carried_frames": carried, "wall_s": time.perf_counter() - t0,
                    "chunk_ms_median": float(np.median(chunk_ms)), "max_grasp_success": grasp,
                    "max_near_object": near, "min_obj_to_target": obj_to_target}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("ckpt")
    p.add_argument("--tasks", nargs="+", required=True)
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--workers", type=int, default=15)
    p.add_argument("--budget-s", type=float, default=60)
    p.add_argument("--json", required=True)
    p.add_argument("--carry-kv", dest="carry_kv", action="store_true", default=True,
                   help="do not reset the engine between episodes (the runtime's behaviour; default)")
    p.add_argument("--reset-kv", dest="carry_kv", action="store_false", help="engine.reset() at each episode")
    a = p.parse_args()
    deploy = json.load(open(os.path.join(a.ckpt, "training_record.json")))["deploy"]
    print("[closed_loop] deploy", json.dumps(deploy), flush=True)
    jobs = [(t, s, a.ckpt, deploy, a.carry_kv) for s in range(a.seeds) for t in a.tasks]
    t0 = time.time()
    results = []
    pool = multiprocessing.get_context("spawn").Pool(a.workers)
    try:
        it = pool.imap_unordered(_episode, jobs)
        while len(results) < len(jobs):
            left = a.budget_s - (time.time() - t0)
            if left <= 0:
                print("[closed_loop] budget spent; partial results", flush=True)
                break
            try:
                results.append(it.next(timeout=left))
            except multiprocessing.TimeoutError:
                print("[closed_loop] budget spent; partial results", flush=True)
                break
    finally:
        pool.terminate()
    summary = {"deploy": deploy, "kv_carried_between_episodes": a.carry_kv, "elapsed_s": time.time() - t0, "episodes": sorted(results, key=lambda r: (r["task"], r["seed"])),
               "tasks": {}}
    for t in a.tasks:
        rs = [r for r in results if r["task"] == t]
        ok = sum(r["success"] for r in rs)
        summary["tasks"][t] = {"episodes": len(rs), "successes": ok,
                               "failed_seeds": sorted(r["seed"] for r in rs if not r["success"]),
                               "median_steps_success": float(np.median([r["steps"] for r in rs if r["success"]]))
                               if ok else None,
                               "chunk_ms_median": float(np.median([r["chunk_ms_median"] for r in rs])) if rs else None}
        print(f"[closed_loop] {t:<22} {ok}/{len(rs)} success (seeds 0..{a.seeds - 1}), "
              f"{summary['tasks'][t]}", flush=True)
    json.dump(summary, open(a.json, "w"), indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
