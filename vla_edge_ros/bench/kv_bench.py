"""KV-manager benchmark: eviction cost per frame and saliency retention per policy.

1. Eviction cost (µs per evicted frame, p50/p99, measured inside ``KVManager.admit``) at a 4096-slot budget
   for every policy, with 32 tokens per frame (127 frames + the pinned prefix) and with 1 token per frame
   (4095 frames: the worst case for the similarity heap); next to it the cost of a plain O(n) rescan of all
   adjacent similarities per eviction (what the heap avoids).
2. Saliency retention: the fraction of salient frames still in the cache k frames later, for semantic
   (evicting the older frame of the most similar pair: the issue's rule, and the newer one for comparison),
   fifo and sliding_window at the same budget, on
   (a) a generated stream of long static stretches (camera noise only) separated by scene changes; the first
       frame of each new scene is salient,
   (b) the same kind of stream where the salient frames are isolated transient events (an object crosses the
       view for one frame) inside the static stretches,
   (c) the real Bridge sample (``../shared/data/oxe/bridge_dataset/1.0.0``) when present: its image_0 JPEG
       frames in episode order; salient = first frame of an episode or a gripper open<->close change.
   Pooled embeddings come from the real patch embedder (engine/vision.py, seeded weights of the tiny default
   geometry), mean over the frame's 32 vision tokens, exactly what the runtime feeds the manager.

Run: ``vla_kv_bench`` (or ``python -m vla_edge_ros.bench.kv_bench``); ``--quick`` for a short run,
``--json FILE`` to save the figures.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from vla_edge_ros.core.kv import KVManager

# (policy, which frame of the most similar pair semantic evicts, protect salient-tagged frames of the pair).
# The first row is the runtime's default.
POLICY_VARIANTS = (("semantic", "older", True), ("semantic", "older", False), ("semantic", "newer", False),
                   ("fifo", "older", False), ("sliding_window", "older", False))


def _label(policy: str, evict: str, protect: bool = False) -> str:
    if policy != "semantic":
        return policy
    return "semantic (default)" if protect else f"semantic(evict {evict}, no tag)"


# ---------------------------------------------------------------------------------------------------------------
# 1. eviction cost
# ---------------------------------------------------------------------------------------------------------------

def eviction_cost(policy: str, tpf: int, n_admits: int, dim: int, budget: int, prefix: int,
                  window: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    vecs = rng.normal(size=(n_admits, dim)).astype(np.float32)
    m = KVManager(budget, tpf, prefix, policy=policy, window_frames=window, timing_samples=n_admits)
    admit_us = np.empty(n_admits)
    for i in range(n_admits):
        t0 = time.perf_counter_ns()
        m.admit(i, vecs[i])
        admit_us[i] = (time.perf_counter_ns() - t0) / 1e3
    st = m.stats()
    steady = admit_us[m.capacity_frames:]  # admits that had to evict
    return {"policy": policy, "tokens_per_frame": tpf, "frames_retained": st["frames_retained"],
            "evictions": st["evictions"], "evict_us_p50": st["eviction_time_us"]["p50"],
            "evict_us_p99": st["eviction_time_us"]["p99"],
            "admit_us_p50": float(np.percentile(steady, 50)) if steady.size else None,
            "admit_us_p99": float(np.percentile(steady, 99)) if steady.size else None}


def rescan_cost(n_frames: int, dim: int, reps: int = 50, seed: int = 0) -> dict:
    """Cost of choosing a semantic victim by recomputing every adjacent similarity (vectorised numpy, no heap)."""
    rng = np.random.default_rng(seed)
    units = rng.normal(size=(n_frames, dim))
    units /= np.linalg.norm(units, axis=1, keepdims=True)
    us = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        sims = np.einsum("ij,ij->i", units[:-1], units[1:])
        int(np.argmax(sims))
        us.append((time.perf_counter_ns() - t0) / 1e3)
    return {"frames": n_frames, "rescan_us_p50": float(np.percentile(us, 50)),
            "rescan_us_p99": float(np.percentile(us, 99))}


# ---------------------------------------------------------------------------------------------------------------
# 2. streams
# ---------------------------------------------------------------------------------------------------------------

def _embedder():
    from vla_edge_ros.engine.config import ModelConfig, tiny_default_dict
    from vla_edge_ros.engine.vision import PatchEmbedder, pooled
    cfg = ModelConfig.from_json(tiny_default_dict())
    emb = PatchEmbedder(cfg)
    return lambda image: pooled(emb(image))


def _scene(rng: np.random.Generator, hw=(96, 128)) -> np.ndarray:
    """A random scene: coarse colour layout (blocks) plus fine texture, float32 in [0, 255]."""
    coarse = rng.uniform(0, 255, size=(3, 4, 3))
    img = np.kron(coarse, np.ones((hw[0] // 3, hw[1] // 4, 1)))
    img += rng.normal(0, 20, size=img.shape)
    return np.clip(img, 0, 255).astype(np.float32)


def _shot(scene: np.ndarray, rng: np.random.Generator, noise: float = 3.0) -> np.ndarray:
    """One camera frame of a static scene: sensor noise only."""
    return np.clip(scene + rng.normal(0, noise, size=scene.shape), 0, 255).astype(np.uint8)


def generated_stream(n: int, kind: str, embed, rng: np.random.Generator,
                     stretch: tuple[int, int] = (100, 400), event_every: tuple[int, int] = (60, 240)):
    """``kind="scene"``: salient = first frame after a scene change. ``kind="event"``: salient = a one-frame
    transient (a bright object in view) inside a static stretch; scenes still change, unmarked."""
    pooled, salient = [], []
    scene, left = None, 0
    next_event = int(rng.integers(*event_every))
    for i in range(n):
        new_scene = left == 0
        if new_scene:
            scene, left = _scene(rng), int(rng.integers(*stretch))
        left -= 1
        if kind == "event" and i == next_event and not new_scene:
            img = scene.copy()
            y, x = int(rng.integers(0, 48)), int(rng.integers(0, 64))
            img[y:y + 48, x:x + 64] = rng.uniform(0, 255, size=3)
            pooled.append(embed(_shot(img, rng)))
            salient.append(True)
            next_event = i + int(rng.integers(*event_every))
            continue
        if kind == "event" and i >= next_event:
            next_event = i + 1
        pooled.append(embed(_shot(scene, rng)))
        salient.append(kind == "scene" and new_scene)
    return pooled, salient


def bridge_stream(path: Path, embed):
    from PIL import Image

    from vla_edge_ros.data.rlds import RLDSDataset
    ds = RLDSDataset(path)
    pooled, salient, kinds = [], [], []
    n_eps = n_start = n_grip = 0
    for ep in ds.episodes():
        n_eps += 1
        images = ep.steps["observation/image_0"]
        gripper = np.round(np.asarray(ep.steps["action"], dtype=np.float64)[:, 6])
        for t, jpeg in enumerate(images):
            with Image.open(io.BytesIO(jpeg)) as im:
                frame = np.asarray(im.convert("RGB"), dtype=np.uint8)
            pooled.append(embed(frame))
            start, grip = t == 0, t > 0 and gripper[t] != gripper[t - 1]
            n_start += start
            n_grip += bool(grip)
            salient.append(bool(start or grip))
            kinds.append("episode start" if start else "gripper change" if grip else "")
    return pooled, salient, kinds, {"episodes": n_eps, "frames": len(pooled), "episode_starts": n_start,
                             "gripper_changes": n_grip}


def retention(pooled, salient, policy: str, evict: str, protect: bool, budget: int, tpf: int, prefix: int,
              window: int, ks) -> dict:
    m = KVManager(budget, tpf, prefix, policy=policy, window_frames=window, semantic_evict=evict,
                  protect_salient=protect, saliency_ks=ks)
    for i, (v, s) in enumerate(zip(pooled, salient)):
        m.admit(i, v, salient=s)
        assert m.occupancy_tokens <= budget
    return {k: v for k, v in m.saliency.retention().items()}


def _fmt(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def print_retention_table(title: str, results: dict, ks) -> None:
    print(f"\n{title}")
    print(f"  {'policy':<24}" + "".join(f"{'k=' + str(k):>13}" for k in ks))
    for label, ret in results.items():
        cells = []
        for k in ks:
            r = ret[k]
            cells.append("-" if r["fraction"] is None else f"{r['retained']}/{r['matured']} {100 * r['fraction']:3.0f}%")
        print(f"  {label:<24}" + "".join(f"{c:>13}" for c in cells))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=int, default=4096, help="KV budget in token slots (prefix included)")
    ap.add_argument("--tokens-per-frame", type=int, default=32)
    ap.add_argument("--prefix", type=int, default=len("pick up the object".encode()),
                    help="pinned prefix tokens (default: the default instruction's UTF-8 bytes)")
    ap.add_argument("--window", type=int, default=16, help="window_frames of sliding_window")
    ap.add_argument("--frames", type=int, default=16000, help="frames of each generated stream")
    ap.add_argument("--cost-admits", type=int, default=6000, help="admits per eviction-cost run")
    ap.add_argument("--bridge", default=None, help="Bridge RLDS directory (default: ../shared/data/oxe/"
                    "bridge_dataset/1.0.0 next to the repository, when present)")
    ap.add_argument("--bridge-budget", type=int, default=1024,
                    help="budget for the Bridge sample (250 frames: 4096 slots would hold them all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="short run (smoke test)")
    ap.add_argument("--json", default=None, help="write all figures to this JSON file")
    a = ap.parse_args(argv)
    if a.quick:
        a.frames, a.cost_admits = 3000, 1500
    out: dict = {"budget_tokens": a.budget, "tokens_per_frame": a.tokens_per_frame, "prefix_tokens": a.prefix,
                 "window_frames": a.window}

    # ---- 1. eviction cost --------------------------------------------------------------------------------
    print(f"Eviction cost per evicted frame at {a.budget} slots (prefix {a.prefix}), µs, "
          f"{a.cost_admits} admits of random 256-d pooled vectors")
    print(f"  {'policy':<16}{'tok/frame':>10}{'frames':>8}{'evict p50':>11}{'evict p99':>11}"
          f"{'admit p50':>11}{'admit p99':>11}")
    cost = []
    for tpf in (a.tokens_per_frame, 1):
        for policy in ("semantic", "fifo", "sliding_window"):
            window = a.window if policy == "sliding_window" else 16
            r = eviction_cost(policy, tpf, a.cost_admits if tpf > 1 else max(a.cost_admits, 8192), 256,
                              a.budget, a.prefix, window, a.seed)
            cost.append(r)
            print(f"  {policy:<16}{tpf:>10}{r['frames_retained']:>8}{_fmt(r['evict_us_p50']):>11}"
                  f"{_fmt(r['evict_us_p99']):>11}{_fmt(r['admit_us_p50']):>11}{_fmt(r['admit_us_p99']):>11}")
    out["eviction_cost"] = cost
    scan = [rescan_cost(n, 256) for n in ((a.budget - a.prefix) // a.tokens_per_frame, a.budget - a.prefix)]
    for s in scan:
        print(f"  (reference: a vectorised numpy rescan of all {s['frames']} adjacent similarities, the O(n) "
              f"per eviction the heap avoids: {s['rescan_us_p50']:.1f} µs p50)")
    out["rescan_reference"] = scan

    # ---- 2. saliency retention ---------------------------------------------------------------------------
    embed = _embedder()
    cap = (a.budget - a.prefix) // a.tokens_per_frame
    ks = (16, 64, 128, 256, 512, 1024)
    out["retention"] = {}
    for kind, title in (("scene", "(a) generated: static stretches of 100-400 frames, salient = first frame "
                                  "after each scene change"),
                        ("event", "(b) generated: static stretches, salient = one-frame transient events "
                                  "every 60-240 frames")):
        rng = np.random.default_rng(a.seed + (1 if kind == "scene" else 2))
        t0 = time.perf_counter()
        pooled, salient = generated_stream(a.frames, kind, embed, rng)
        res = {_label(p, e, t): retention(pooled, salient, p, e, t, a.budget, a.tokens_per_frame, a.prefix, a.window,
                                       ks) for p, e, t in POLICY_VARIANTS}
        print_retention_table(f"{title}\n  {a.frames} frames, {sum(salient)} salient, budget {a.budget} tokens "
                              f"= {cap} frames, window {a.window}; retained/matured after k frames "
                              f"({time.perf_counter() - t0:.1f} s)", res, ks)
        out["retention"][kind] = {"frames": a.frames, "salient": int(sum(salient)),
                                  "results": {lbl: {str(k): v for k, v in r.items()} for lbl, r in res.items()}}

    bridge = Path(a.bridge) if a.bridge else Path(__file__).resolve().parents[2].parent / "shared/data/oxe/" \
        "bridge_dataset/1.0.0"
    if bridge.exists():
        pooled, salient, kinds, info = bridge_stream(bridge, embed)
        bks = (4, 8, 16, 32, 64)
        bcap = (a.bridge_budget - a.prefix) // a.tokens_per_frame
        res = {_label(p, e, t): retention(pooled, salient, p, e, t, a.bridge_budget, a.tokens_per_frame, a.prefix,
                                       a.window, bks) for p, e, t in POLICY_VARIANTS}
        print_retention_table(f"(c) Bridge sample {bridge}: {info['episodes']} episodes, {info['frames']} frames, "
                              f"{sum(salient)} salient ({info['episode_starts']} episode starts, "
                              f"{info['gripper_changes']} gripper changes)\n  budget {a.bridge_budget} tokens = "
                              f"{bcap} frames, window {a.window}", res, bks)
        by_kind = {}
        for kind in ("episode start", "gripper change"):
            tags = [k == kind for k in kinds]
            by_kind[kind] = {_label(p, e, t): retention(pooled, tags, p, e, t, a.bridge_budget, a.tokens_per_frame,
                                                     a.prefix, a.window, bks) for p, e, t in POLICY_VARIANTS}
            print_retention_table(f"(c) Bridge, salient = {kind} only", by_kind[kind], bks)
        out["retention"]["bridge_by_kind"] = {kind: {lbl: {str(k): v for k, v in r.items()} for lbl, r in
                                                     res_k.items()} for kind, res_k in by_kind.items()}
        out["retention"]["bridge"] = {**info, "salient": int(sum(salient)), "budget_tokens": a.bridge_budget,
                                      "results": {lbl: {str(k): v for k, v in r.items()} for lbl, r in res.items()}}
    else:
        print(f"\n(c) Bridge sample not found at {bridge}: skipped (pass --bridge DIR)")

    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"\nfigures written to {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
