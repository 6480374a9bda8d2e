"""Where a chunk policy's commanded jerk comes from (docs/SIM_CHUNKS.md, issue 22): closed_loop.py's synchronous loop
(``play_episode``; numpy engine as the deploy block says, push), for the single-step policy and a chunk policy
played 2 and H steps per chunk.

Per setting it prints one JSON line: successes, and the mean squared second difference of the applied xyz deltas
(the commanded trajectory's jerk x dt^3, up to a constant), split into triples of steps inside one chunk and
triples that cross a chunk switch; for chunks played in part, how far each new chunk's step 0 is from the previous
chunk's prediction for the same tick. If the triples inside a chunk are as rough as those across a switch, the
jerk is the policy's own, not the merging of chunks. ``--readout expectation`` runs the chunk policy's engine with
``action_readout`` expectation (each slot played as the mean of its bin distribution: engine/geometry.py).

    MUJOCO_GL=egl python tools/train_policy/jerk_probe.py results/policy_h200_p4 --seeds 8
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # closed_loop.py: the loop this probes


def probe(ckpt: str, exec_steps: int, seeds: list, readout: str = "argmax") -> dict:
    import vla_edge_ros.sim  # noqa: F401  MUJOCO_GL before mujoco
    from vla_edge_ros.sim.metaworld_env import MetaWorldSim

    from closed_loop import load_deploy, make_policy_engine, play_episode

    deploy = load_deploy(ckpt)
    h, w = deploy["image_hw"]
    sim = MetaWorldSim("push", "corner", w, h, 200)
    eng = make_policy_engine(ckpt, deploy, "numpy", sim.instruction, action_readout=readout)
    fid, successes = 0, 0
    across, inside, disagree = [], [], []
    for seed in seeds:
        applied, starts, prev = [], set(), [None]

        def on_chunk(_result, chunk):
            if prev[0] is not None and prev[0].shape[0] > exec_steps:
                disagree.append(float(np.sum((chunk[0, :3] - prev[0][exec_steps, :3]) ** 2)))
            prev[0] = chunk
            starts.add(len(applied))
            return chunk

        res, fid = play_episode(sim, eng, seed, fid, exec_steps, on_chunk=on_chunk,
                                on_step=lambda a: applied.append(np.asarray(a[:3], float)))
        successes += int(res.success)
        xyz = np.array(applied)
        for t in range(2, len(xyz)):  # the triple t-2, t-1, t lies in one chunk unless t-1 or t starts one
            d2 = float(np.sum((xyz[t] - 2 * xyz[t - 1] + xyz[t - 2]) ** 2))
            (across if (t in starts or t - 1 in starts) else inside).append(d2)
    mean = (lambda v: float(np.mean(v)) if v else None)
    return {"checkpoint": ckpt, "exec_steps": exec_steps, "readout": readout, "episodes": len(seeds),
            "successes": successes,
            "d2_all": mean(across + inside), "d2_across_switch": mean(across), "d2_inside_chunk": mean(inside),
            "new_step0_vs_old_prediction_sq": mean(disagree)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("chunk_checkpoint")
    p.add_argument("--single-checkpoint", default="metaworld_mt3")
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--readout", default="argmax", choices=("argmax", "expectation"), help="the chunk policy's")
    a = p.parse_args()
    from vla_edge_ros.engine import shipped
    from vla_edge_ros.engine.config import ModelConfig

    single = str(shipped.resolve(a.single_checkpoint))
    horizon = ModelConfig.from_json(a.chunk_checkpoint).action_horizon
    seeds = list(range(a.seeds))
    for ckpt, steps in ((single, 1), (a.chunk_checkpoint, 2), (a.chunk_checkpoint, horizon)):
        print(json.dumps(probe(ckpt, steps, seeds, a.readout if steps > 1 else "argmax")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
