"""Synchronous closed loop without ROS: MetaWorldSim + the numpy engine (--backend; make_engine,
checkpoint:=DIR), one chunk per control step, as the runtime steps it: render the camera image (same camera / size
as the demos), encode, run_chunk (KV eviction as the deploy block says), offer the action as 'fresh' to the
SimController, one control step. Held-out seeds 0.. (demos used 1 000 000 ..). Episodes run in spawned worker
processes.

Differences from the ROS loop: no timing (every step gets the chunk of the frame rendered just before it).
Action chunks (a checkpoint with vla.action_horizon H > 1): "synchronous chunks" -- render, run a chunk, apply
its first --exec-steps actions (default H) one per control step (ChunkResult.chunk, an (H, action_dims) array
whose row 0 is .action), then render and run the next chunk. The engine then sees one frame per chunk, so its
retained frames are exec_steps control steps apart: train such a policy with --frame-stride exec_steps (the
deploy block's frame_stride_control_steps), which this script checks and reports. H = 1 with exec_steps 1 is the
single-step loop above, unchanged.
--backend cuda (the GPU machine) runs the same loop on the CUDA engine: the two engines' closed loops on the same
seeds, without ROS (docs/SIM_CHUNKS.md: the runtime's cuda figure for a parallel-decoding chunk policy sat below this
loop's numpy figure).
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


def load_deploy(ckpt):
    """The checkpoint's deploy block (training_record.json, written by train_eval.py), None without a record."""
    path = os.path.join(ckpt, "training_record.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)["deploy"]


def make_policy_engine(ckpt, deploy, backend, instruction, action_readout="argmax"):
    """The engine as the checkpoint's deploy block (training_record.json) says to run it."""
    from vla_edge_ros.engine.factory import make_engine

    eng = make_engine({"checkpoint": ckpt, "backend": backend, "instruction": instruction,
                       "tokens_per_frame": deploy["tokens_per_frame"], "decode_tokens": 8,
                       "eviction_policy": deploy["eviction_policy"], "window_frames": deploy["window_frames"],
                       "action_readout": action_readout},
                      log=lambda s: None)
    problem = eng.chunk_support_problem()
    if problem:
        raise RuntimeError(f"engine: {problem}")
    return eng


def play_episode(sim, eng, seed, fid, exec_steps, on_chunk=None, on_step=None):
    """One episode of seed ``seed``: render, run a chunk (frame ids from ``fid``), apply its first ``exec_steps``
    actions one per control step, again until the episode ends. ``on_chunk(result, chunk)`` may return the
    (H, action_dims) actions to play instead of ``chunk``; ``on_step(action)`` sees each applied action.
    Returns (the episode's result, the next frame id)."""
    from vla_edge_ros.sim.episode import SimController

    ctl = SimController(sim, seed_start=seed, num_episodes=1, action_timeout_ms=1e9)
    while True:
        r = eng.run_chunk(eng.encode_frame(sim.render()), fid)
        fid += 1
        chunk = np.asarray(r.chunk if getattr(r, "chunk", None) is not None else np.reshape(r.action, (1, -1)))
        row0_is_action = np.array_equal(chunk[0].astype(np.float32), np.asarray(r.action, np.float32))
        if chunk.shape[0] < exec_steps or not row0_is_action:
            raise RuntimeError(f"engine returned a chunk of shape {chunk.shape} (row 0 must be .action) for "
                               f"exec_steps={exec_steps}: this engine does not decode the checkpoint's chunks")
        if on_chunk is not None:
            replaced = on_chunk(r, chunk)
            chunk = chunk if replaced is None else replaced
        for action in chunk[:exec_steps]:  # synchronous chunks: one chunk step per control step
            reason = ctl.offer("fresh", action, eng.action_names)
            if reason is not None:
                raise RuntimeError(f"action rejected: {reason} {ctl.last_rejection}")
            res = ctl.control_step()
            if on_step is not None:
                on_step(action)
            if res is not None:
                return res, fid


def _episode(job):
    task, seed, ckpt, deploy, carry_kv, exec_steps, backend = job
    import vla_edge_ros.sim  # noqa: F401  MUJOCO_GL before mujoco
    from vla_edge_ros.sim.metaworld_env import MetaWorldSim

    if task not in _CACHE:
        h, w = deploy["image_hw"]
        sim = MetaWorldSim(task, "corner", w, h, 200)
        _CACHE[task] = [sim, make_policy_engine(ckpt, deploy, backend, sim.instruction), 0]
    sim, eng, fid = _CACHE[task]
    carried = len(eng.kv.frames) if carry_kv else 0
    if not carry_kv:
        eng.reset()
    t0 = time.perf_counter()
    chunk_ms = []
    seen = {"grasp": 0.0, "near": 0.0, "obj_to_target": float("inf")}  # push diagnostics from MetaWorld's info

    def on_step(_action):
        info = sim.last_info or {}
        seen["grasp"] = max(seen["grasp"], float(info.get("grasp_success", 0.0)))
        seen["near"] = max(seen["near"], float(info.get("near_object", 0.0)))
        seen["obj_to_target"] = min(seen["obj_to_target"], float(info.get("obj_to_target", float("inf"))))

    res, _CACHE[task][2] = play_episode(sim, eng, seed, fid, exec_steps,
                                        on_chunk=lambda r, chunk: chunk_ms.append(r.total_ms), on_step=on_step)
    return {"task": task, "seed": seed, "success": bool(res.success), "steps": res.steps,
            "chunks": len(chunk_ms), "saturated": res.saturated, "carried_frames": carried,
            "wall_s": time.perf_counter() - t0, "chunk_ms_median": float(np.median(chunk_ms)),
            "max_grasp_success": seen["grasp"], "max_near_object": seen["near"],
            "min_obj_to_target": seen["obj_to_target"]}


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
    p.add_argument("--backend", default="numpy", choices=("numpy", "cuda"), help="the engine (make_engine)")
    p.add_argument("--exec-steps", type=int, default=0,
                   help="actions of each chunk applied before the next chunk (0 = the checkpoint's action_horizon)")
    a = p.parse_args()
    from vla_edge_ros.engine.config import ModelConfig

    horizon = ModelConfig.from_json(a.ckpt).action_horizon
    exec_steps = a.exec_steps or horizon
    if not 1 <= exec_steps <= horizon:
        p.error(f"--exec-steps must be in [1, action_horizon={horizon}], got {exec_steps}")
    deploy = load_deploy(a.ckpt)
    if deploy is None:
        p.error(f"{a.ckpt} has no training_record.json (its deploy block says how to run it)")
    print("[closed_loop] deploy", json.dumps(deploy), f"action_horizon {horizon}, exec_steps {exec_steps}",
          flush=True)
    stride = int(deploy.get("frame_stride_control_steps", 1))
    stride_note = None
    if deploy.get("window_frames", 1) > 1 and stride != exec_steps:
        stride_note = (f"the policy was trained with past frames {stride} control step(s) apart; this loop retains "
                       f"frames {exec_steps} apart (one per chunk)")
        print(f"[closed_loop] note: {stride_note}", flush=True)
    jobs = [(t, s, a.ckpt, deploy, a.carry_kv, exec_steps, a.backend) for s in range(a.seeds) for t in a.tasks]
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
    summary = {"deploy": deploy, "backend": a.backend, "kv_carried_between_episodes": a.carry_kv,
               "action_horizon": horizon,
               "exec_steps": exec_steps, "frame_stride_note": stride_note, "elapsed_s": time.time() - t0,
               "episodes": sorted(results, key=lambda r: (r["task"], r["seed"])), "tasks": {}}
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
