"""Training samples = the contexts the runtime builds at inference, drawn from bag episodes (numpy only).

At inference (engine/reference.py reference_chunk, NumpyEngine.run_chunk) a chunk is

    [instruction bytes, pinned]  [retained past frames, oldest -> newest]  [current frame]  [decode tokens]
     positions 0 .. P-1           P + j*tpf .. (packed: eviction renumbers)   n_ctx-tpf .. n_ctx-1  n_ctx + i - 1

with byte b -> token id b, each frame's ``tpf`` patch tokens from the patch embedder, and greedy decode over the
action rows of the LM head: gen[0] from the current frame's last token, then decode step i feeds gen[i-1] and
yields gen[i]; gen[1..A] are the action bins, A = H * action_dims for an action chunk of H = ``horizon``
(the checkpoint's vla.action_horizon) steps. A training sample is exactly that sequence, teacher forced: the
A + 1 decode inputs are the targets shifted by one, and the A + 2 targets are

    gen[0]                = action bin START_BIN (0)       a fixed "action start" token
    gen[1..A]             = the bins of the recorded actions at control steps t, t+1, .., t+H-1 of the episode,
                            time-major (step t's action_dims bins, then step t+1's ...; core/action_tokenizer.py,
                            q01/q99 of the data)
    gen[A + 1]            = action bin n_bins - 1          a fixed end token (H = 1: the runtime's 8th decode step)

both fixed tokens are action rows, because the engines take the argmax over the action rows only. H = 1 is the
single-step layout [START, bins(t), END] (what every checkpoint before issue 22 was trained on).

Action chunks (H > 1). A bag step is one control step (data/bag_reader.py: an image and the recorded action of
one stamp), and the executor plays one chunk step per control tick, so a chunk's steps are consecutive bag steps
t .. t+H-1 whatever ``frame_stride`` says (that only spaces the retained past frames). Steps past the episode's
end are padding (LeRobot's action_is_pad): their targets are masked out of the loss (``target_mask`` False), and
so is END after a padded chunk (the chunk never ended where END would sit); their inputs repeat the last
action's bins (any value would do: no unmasked target comes after them). START and every step inside the
episode are always in the loss; with H = 1 nothing is ever padded.

Past frames: the k most recent frames before the current one, ``frame_stride`` control steps apart (the
camera-to-control ratio: one chunk per camera frame), with k drawn uniformly in [0, max_past_frames] per batch
and clipped at the episode start ("recent": what FIFO and sliding-window eviction leave); or ``past_sampling=
"subset"``: k frames drawn without replacement from the last ``subset_window`` candidates, kept in order (what
semantic eviction leaves: a sparse older history). Positions are packed either way, as the KV manager assigns.
One known difference from the runtime: the runtime computes a retained frame's K/V once, when it arrived,
against the context of that moment; a training sample computes them against the sample's own older frames.
The two are identical until the first eviction of an episode (a test holds them equal there) and differ in
the deeper layers' K/V of older frames after it. Deploy with at most ``max_past_frames + 1`` retained frames
(eviction_policy sliding_window, window_frames = max_past_frames + 1, or a kv_budget_tokens that holds no more),
so the policy never sees positions it was not trained at.

Images are resized to the checkpoint's patch_grid * patch_size with engine/vision.py's own resize (exact, no
copy when the bag is recorded at that size) and shifted by up to ``shift_px`` pixels (edge padding; the same
shift for all frames of a sample) as augmentation, optionally with a brightness offset per sample and Gaussian
pixel noise (ContextSpec.brightness / pixel_noise: renderers and cameras differ by a few levels). Episodes are
split into train / held-out by a seeded permutation, and q01/q99 come from the training episodes only.

Batches are drawn as indices (Rows: episode, frame steps, shift per sample; vectorised, no per-sample loop), so
the trainer can gather them from one frame tensor on its device (train/trainer.py DeviceData); ``to_batch``
gathers the same Rows in numpy, the reference that a test holds the device gather to. The chunk targets are
index arithmetic on both sides (``chunk_targets``: step t + j clipped at the episode's last step, valid while
t + j < T), so H does not change what is drawn: the same seed gives the same Rows for every H.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from vla_edge_ros.core.action_tokenizer import ActionTokenizer
from vla_edge_ros.data.bag_reader import BagEpisode
from vla_edge_ros.engine.vision import check_image, resize

START_BIN = 0  # gen[0] target (see the module docstring)
_UNPICKED = np.iinfo(np.int64).min  # sorts before every picked "-frames back"
PAST_SAMPLING = ("recent", "subset")


def end_bin(n_bins: int) -> int:
    """gen[action_dims + 1] target: the last action bin."""
    return n_bins - 1


def prefix_ids(instruction: str) -> np.ndarray:
    """Instruction -> token ids, as engine/numpy_backend.prefix_token_ids and engine/reference.py: UTF-8 bytes."""
    return np.frombuffer(instruction.encode("utf-8"), dtype=np.uint8).astype(np.int64)


@dataclass(frozen=True)
class ContextSpec:
    max_past_frames: int = 3
    frame_stride: int = 1
    past_sampling: str = "recent"
    subset_window: int = 0  # candidates for "subset"; 0 = 2 * max_past_frames
    shift_px: int = 4
    # Photometric augmentation, in pixel levels (0..255). The same scene rendered by Mesa (the CPU machine) is
    # ~1.5 levels brighter than by NVIDIA EGL (the training machine), per-pixel |d| std ~3, edges up to ~100
    # (tools/train_policy/render_probe.py): a policy trained on one renderer meets the other at deployment, as a
    # real camera meets exposure changes and sensor noise.
    brightness: float = 0.0  # per sample, one offset uniform in [-brightness, brightness] for all its frames
    pixel_noise: float = 0.0  # std of Gaussian noise per pixel and channel (drawn by the trainer's device gather)

    def __post_init__(self) -> None:
        if (self.max_past_frames < 0 or self.frame_stride < 1 or self.shift_px < 0 or self.subset_window < 0
                or not (0.0 <= self.brightness <= 128.0) or not (0.0 <= self.pixel_noise <= 64.0)):
            raise ValueError(f"context: max_past_frames >= 0, frame_stride >= 1, shift_px >= 0, subset_window >= 0, "
                             f"brightness in [0, 128] and pixel_noise in [0, 64] are required, got {self}")
        if self.past_sampling not in PAST_SAMPLING:
            raise ValueError(f"past_sampling must be one of {', '.join(PAST_SAMPLING)}, got {self.past_sampling!r}")

    @property
    def window(self) -> int:
        return self.subset_window or 2 * self.max_past_frames


@dataclass
class TrainEpisode:
    prefix_ids: np.ndarray  # (P,) int64
    pixels: np.ndarray  # (T, H, W, 3) at the model's image size: uint8 (recorded at it) or float16 (resized)
    actions: np.ndarray  # (T, action_dims) float64
    source: str
    bins: np.ndarray = field(default=None)  # (T, action_dims) int64, set once q01/q99 are known

    @property
    def steps(self) -> int:
        return int(self.actions.shape[0])


@dataclass
class Rows:
    """A batch as indices -- what both the numpy Batch (to_batch) and the trainer's device gather read.

    ``frames`` holds each sample's frame steps right-aligned, oldest -> current, -1 where a sample has fewer
    past frames than the widest one (right-aligned: a row's valid entries are contiguous, so a row-major boolean
    pick gives every sample's frames in order); the last column is the current step."""
    episodes: np.ndarray  # (B,) int64
    frames: np.ndarray  # (B, K + 1) int64 steps, -1 = none
    shifts: np.ndarray  # (B, 2) int64 (dy, dx): one image shift per sample, zeros without augmentation
    brightness: np.ndarray | None = None  # (B,) float32 offsets in pixel levels per sample; None = zeros
    augmented: bool = False  # training rows: the device gather adds ContextSpec.pixel_noise

    def __len__(self) -> int:
        return int(self.episodes.shape[0])

    @property
    def current(self) -> np.ndarray:
        return self.frames[:, -1]

    @property
    def frame_counts(self) -> np.ndarray:
        return (self.frames >= 0).sum(axis=1)

    def take(self, sl: slice) -> "Rows":
        return Rows(self.episodes[sl], self.frames[sl], self.shifts[sl],
                    None if self.brightness is None else self.brightness[sl], self.augmented)


@dataclass
class Batch:
    prefix_ids: list[np.ndarray]  # per sample (P_b,)
    frames: np.ndarray  # (sum F_b, H, W, 3) float32 pixels in [0, 255]: each sample's past frames, then current
    frame_counts: np.ndarray  # (B,) F_b = past frames + 1
    targets: np.ndarray  # (B, A + 2) action bins: START, the chunk's H * action_dims bins (time-major), END
    target_mask: np.ndarray  # (B, A + 2) bool: False for the targets of padded steps (past the episode) and END

    def __len__(self) -> int:
        return len(self.prefix_ids)


def shift_index(n: int, shift: np.ndarray) -> np.ndarray:
    """(F,) shifts -> (F, n) source rows of an edge-padded shift: out[y] = in[clip(y + shift, 0, n - 1)], which
    is np.pad(mode="edge") then the crop at s + shift, without the copy (numpy or torch index arithmetic)."""
    return np.clip(np.arange(n)[None, :] + np.asarray(shift)[:, None], 0, n - 1)


def to_model_pixels(frames: np.ndarray, image_hw: tuple[int, int]) -> np.ndarray:
    """(T, h, w, 3) uint8 -> (T, H, W, 3) at the patch embedder's size: the frames themselves when they are
    recorded at it (the resize is then the identity), else engine/vision.resize, stored exactly as float16
    (averages of 4 bytes are multiples of 1/4 below 256)."""
    if tuple(frames.shape[1:3]) == tuple(image_hw):
        return np.ascontiguousarray(frames, dtype=np.uint8)
    return np.stack([resize(check_image(f), image_hw) for f in frames]).astype(np.float16)


def quantiles(actions: np.ndarray) -> tuple[list[float], list[float]]:
    """q01 / q99 per dimension (OpenVLA's BOUNDS_Q99 statistics)."""
    q = np.quantile(actions, [0.01, 0.99], axis=0)
    return [float(v) for v in q[0]], [float(v) for v in q[1]]


class DemoDataset:
    """Episodes split into train / held-out, tokenised with q01/q99 of the training split; draws Batches."""

    def __init__(self, episodes: Sequence[BagEpisode], image_hw: tuple[int, int], vocab_size: int, n_bins: int,
                 context: ContextSpec = ContextSpec(), holdout_frac: float = 0.1, seed: int = 0, horizon: int = 1):
        if not episodes:
            raise ValueError("no episodes to train on")
        if not 0.0 <= holdout_frac < 1.0:
            raise ValueError(f"holdout_frac must be in [0, 1), got {holdout_frac}")
        if isinstance(horizon, bool) or not isinstance(horizon, (int, np.integer)) or horizon < 1:
            raise ValueError(f"action horizon must be an integer >= 1, got {horizon!r}")
        self.context, self.image_hw, self.n_bins, self.horizon = context, tuple(image_hw), int(n_bins), int(horizon)
        self.instructions = Counter()
        self.episodes: list[TrainEpisode] = []
        for e in episodes:
            self.instructions[e.instruction] += 1
            self.episodes.append(TrainEpisode(prefix_ids(e.instruction), to_model_pixels(e.frames, image_hw),
                                              np.asarray(e.actions, dtype=np.float64), f"{e.bag}#{e.index}"))
        n = len(self.episodes)
        order = np.random.default_rng(seed).permutation(n)
        n_hold = min(n - 1, max(1, int(round(holdout_frac * n)))) if holdout_frac > 0 and n > 1 else 0
        self.heldout_idx = sorted(int(i) for i in order[:n_hold])
        self.train_idx = sorted(int(i) for i in order[n_hold:])
        train_actions = np.concatenate([self.episodes[i].actions for i in self.train_idx])
        self.q01, self.q99 = quantiles(train_actions)
        self.tokenizer = ActionTokenizer(vocab_size, self.q01, self.q99, n_bins)
        for ep in self.episodes:
            ep.bins = self.tokenizer.action_to_bins(ep.actions)
        # every episode's steps in one array, for the chunk targets' index arithmetic (and DeviceData's copy)
        self.lengths = np.array([ep.steps for ep in self.episodes], np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)
        self.all_bins = np.concatenate([ep.bins for ep in self.episodes]).astype(np.int64)  # (sum T, action_dims)
        self.varying_dims = [i for i in range(len(self.q01)) if self.q99[i] > self.q01[i]]
        self._steps = {name: np.array([(i, t) for i in idx for t in range(self.episodes[i].steps)], dtype=np.int64)
                       for name, idx in (("train", self.train_idx), ("heldout", self.heldout_idx))}

    # ---- facts -------------------------------------------------------------------------------------------
    def steps(self, split: str) -> int:
        return len(self._steps[split])

    def describe(self) -> dict:
        return {"episodes": len(self.episodes), "train_episodes": len(self.train_idx),
                "heldout_episodes": len(self.heldout_idx), "train_steps": self.steps("train"),
                "heldout_steps": self.steps("heldout"), "instructions": dict(self.instructions),
                "heldout_sources": [self.episodes[i].source for i in self.heldout_idx],
                "q01": self.q01, "q99": self.q99, "varying_dims": self.varying_dims,
                "action_horizon": self.horizon, "padded_chunk_steps": self.padded_steps()}

    def padded_steps(self) -> dict[str, int]:
        """Chunk steps past an episode's end over all samples of each split (masked out of the loss): an
        episode of T steps has sum over left = 1..T of max(0, H - left) = m (2H - 1 - m) / 2, m = min(H - 1, T)."""
        m = np.minimum(self.horizon - 1, self.lengths)
        per_episode = m * (2 * self.horizon - 1 - m) // 2
        return {"train": int(per_episode[self.train_idx].sum()), "heldout": int(per_episode[self.heldout_idx].sum())}

    def targets(self, bins: np.ndarray) -> np.ndarray:
        """(action_dims,) or (H, action_dims) bins -> (A + 2,) targets: START, the bins time-major, END."""
        return np.concatenate([[START_BIN], np.asarray(bins, dtype=np.int64).reshape(-1), [end_bin(self.n_bins)]])

    def chunk_targets(self, episodes: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(B,) episodes and current steps -> targets (B, A + 2) and target_mask (B, A + 2), vectorised: step
        t + j's bins (clipped at the episode's last step, so a padded step repeats the last action) and whether
        t + j is inside the episode (module docstring). trainer.DeviceData.batch does the same in torch."""
        e, t = np.asarray(episodes, np.int64), np.asarray(t, np.int64)
        left = self.lengths[e] - t  # steps from t to the episode's end, t included (>= 1)
        if np.any(left < 1) or np.any(t < 0):
            raise ValueError("chunk targets: a current step outside its episode")
        j = np.arange(self.horizon)[None, :]
        valid = j < left[:, None]  # (B, H)
        src = (self.offsets[e] + t)[:, None] + np.minimum(j, left[:, None] - 1)
        bins = self.all_bins[src].reshape(len(e), -1)  # (B, H * action_dims), time-major
        col = np.ones((len(e), 1), np.int64)
        targets = np.concatenate([START_BIN * col, bins, end_bin(self.n_bins) * col], axis=1)
        dims = self.all_bins.shape[1]
        mask = np.concatenate([col.astype(bool), np.repeat(valid, dims, axis=1), valid[:, -1:]], axis=1)
        return targets, mask

    # ---- samples -----------------------------------------------------------------------------------------
    def past_steps(self, t: np.ndarray, k, rng: np.random.Generator | None) -> np.ndarray:
        """Past frames of current steps t (B,), at most k (an int or (B,)) each, never before the episode:
        (B, max k) steps right-aligned, oldest -> newest, -1 = none. ``rng`` None: "recent" whatever the
        context's sampling (evaluation); else one draw of distinct candidates per sample (module docstring)."""
        c = self.context
        t = np.asarray(t, dtype=np.int64)
        k = np.broadcast_to(np.asarray(k, dtype=np.int64), t.shape)
        width = int(k.max()) if k.size else 0
        avail = t // c.frame_stride
        if c.past_sampling == "recent" or rng is None:
            kk = np.minimum(k, avail)
            back = width - np.arange(width)[None, :]  # column -> frames back: width .. 1 (the newest last)
            ok = back <= kk[:, None]
            return np.where(ok, t[:, None] - back * c.frame_stride, -1)
        cands = np.minimum(avail, np.maximum(c.window, k))
        kk = np.minimum(k, cands)
        n_cands = int(cands.max()) if cands.size else 0
        keys = rng.random((len(t), n_cands))
        keys[np.arange(1, n_cands + 1)[None, :] > cands[:, None]] = np.inf  # beyond a sample's candidates
        picked = np.zeros((len(t), width), np.int64)  # frames back; 0 = not picked
        first = np.argsort(keys, axis=1, kind="stable")[:, :width] + 1  # random candidates, valid ones first
        picked[:, :first.shape[1]] = first
        picked = np.where(np.arange(width)[None, :] < kk[:, None], picked, 0)  # kk_b distinct picks
        order = np.sort(np.where(picked > 0, -picked, _UNPICKED), axis=1)  # unpicked, then oldest -> newest
        return np.where(order > _UNPICKED, t[:, None] + order * c.frame_stride, -1)

    def past_indices(self, t: int, k: int, rng: np.random.Generator | None) -> list[int]:
        """Steps of the past frames for current step t (oldest first), at most k, never before the episode."""
        row = self.past_steps(np.array([t]), k, rng)[0]
        return [int(v) for v in row if v >= 0]

    def rows(self, steps: np.ndarray, k, rng: np.random.Generator | None, augment: bool = True) -> Rows:
        """(B, 2) (episode, current step) -> Rows with up to k past frames each; shifts drawn from ``rng`` when
        ``augment`` (zeros without an rng)."""
        steps = np.asarray(steps, dtype=np.int64).reshape(-1, 2)
        past = self.past_steps(steps[:, 1], k, rng)
        s = self.context.shift_px
        shifts = (rng.integers(-s, s + 1, size=(len(steps), 2)) if augment and s and rng is not None
                  else np.zeros((len(steps), 2), np.int64))
        return Rows(steps[:, 0].copy(), np.concatenate([past, steps[:, 1:]], axis=1), shifts.astype(np.int64),
                    self._brightness(len(steps), rng if augment else None), bool(augment and rng is not None))

    def _brightness(self, n: int, rng: np.random.Generator | None) -> np.ndarray | None:
        b = self.context.brightness
        return rng.uniform(-b, b, size=n).astype(np.float32) if b and rng is not None else None

    def sample_rows(self, rng: np.random.Generator, batch_size: int, split: str = "train") -> Rows:
        """A training batch as indices: steps uniform over the split, one k for the batch (module docstring)."""
        steps = self._steps[split]
        if len(steps) == 0:
            raise ValueError(f"the {split} split is empty")
        picks = steps[rng.integers(0, len(steps), size=batch_size)]
        k = int(rng.integers(0, self.context.max_past_frames + 1))
        return self.rows(picks, k, rng)

    def to_batch(self, rows: Rows) -> Batch:
        """Rows -> numpy Batch: the reference of the trainer's device gather (the same index arithmetic)."""
        counts = rows.frame_counts
        frames = []
        for i, (e, steps, (dy, dx)) in enumerate(zip(rows.episodes, rows.frames, rows.shifts)):
            px = self.episodes[int(e)].pixels[steps[steps >= 0]]
            ys = shift_index(px.shape[1], [dy])[0]
            xs = shift_index(px.shape[2], [dx])[0]
            px = px[:, ys][:, :, xs].astype(np.float32)
            if rows.brightness is not None:  # pixel_noise is the device gather's alone (trainer.DeviceData)
                px = np.clip(px + rows.brightness[i], 0.0, 255.0)
            frames.append(px)
        targets, mask = self.chunk_targets(rows.episodes, rows.current)
        return Batch([self.episodes[int(e)].prefix_ids for e in rows.episodes], np.concatenate(frames),
                     counts.astype(np.int64), targets, mask)

    def make_batch(self, rows: Sequence[tuple[int, int, list[int]]], rng: np.random.Generator | None) -> Batch:
        """rows of (episode, current step, past steps) -> Batch; ``rng`` None: no augmentation."""
        width = max((len(p) for _, _, p in rows), default=0)
        frames = np.full((len(rows), width + 1), -1, np.int64)
        for i, (_, t, past) in enumerate(rows):
            frames[i, width - len(past):] = [*past, t]
        s = self.context.shift_px
        shifts = (rng.integers(-s, s + 1, size=(len(rows), 2)) if s and rng is not None
                  else np.zeros((len(rows), 2), np.int64))
        return self.to_batch(Rows(np.array([e for e, _, _ in rows], np.int64), frames, shifts,
                                  self._brightness(len(rows), rng), rng is not None))

    def sample(self, rng: np.random.Generator, batch_size: int, split: str = "train") -> Batch:
        """A training batch (numpy; the trainer gathers sample_rows on its device instead)."""
        return self.to_batch(self.sample_rows(rng, batch_size, split))

    def eval_rows(self, batch_size: int, split: str = "heldout", max_samples: int = 2048, seed: int = 0,
                  past_frames: int | None = None, steps: np.ndarray | None = None) -> list[Rows]:
        """A fixed evaluation set: up to ``max_samples`` steps of the split (or the (N, 2) ``steps`` given),
        seeded, no augmentation, with ``past_frames`` most recent past frames each (clipped at the episode
        start; None: k drawn uniformly in [0, max_past_frames] per sample), in batches of similar length."""
        steps = self._steps[split] if steps is None else np.asarray(steps, dtype=np.int64).reshape(-1, 2)
        if len(steps) == 0:
            return []
        rng = np.random.default_rng(seed)
        if len(steps) > max_samples:
            steps = steps[np.sort(rng.choice(len(steps), size=max_samples, replace=False))]
        k = (rng.integers(0, self.context.max_past_frames + 1, size=len(steps)) if past_frames is None
             else np.full(len(steps), past_frames))
        rows = self.rows(steps, k, None, augment=False)
        order = np.argsort(rows.frame_counts, kind="stable")  # similar lengths together: less padding
        rows = rows.take(order)
        out = []
        for i in range(0, len(rows), batch_size):
            r = rows.take(slice(i, i + batch_size))
            keep = int(r.frame_counts.max())  # the batch's widest sample sets its width
            out.append(Rows(r.episodes, r.frames[:, -keep:], r.shifts))
        return out

    def eval_batches(self, batch_size: int, split: str = "heldout", max_samples: int = 2048, seed: int = 0,
                     past_frames: int | None = None) -> list[Batch]:
        """eval_rows as numpy Batches."""
        return [self.to_batch(r) for r in self.eval_rows(batch_size, split, max_samples, seed, past_frames)]
