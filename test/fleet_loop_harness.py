"""The fake world of test_fleet_loop.py: a fake clock, frames, a batched fake engine that records its batches and
can be told to fail, and ``harness`` (a FleetLoop over them, with each robot's double buffer and delivered results)."""
import time
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from fake_clock import MS, FakeClock
from vla_edge_ros.core.double_buffer import DoubleBuffer
from vla_edge_ros.core.fleet_loop import FleetLoop
from vla_edge_ros.core.fleet_scheduler import FleetScheduler
from vla_edge_ros.engine.interface import ChunkResult

STEPS = 8
DECODE_MS = 4.0


@dataclass
class Frame:
    image: np.ndarray
    stamp_ns: int
    frame_id: int


def frame(fid: int, shape=(8, 8, 3)) -> Frame:
    img = np.full(shape, (fid * 37) % 256, np.uint8)
    img[0, 0] = 255 - img[0, 0]  # never a constant image: tokens are not all equal
    return Frame(img, stamp_ns=fid * 33 * MS, frame_id=fid)


class FakeBatchEngine:
    """A pass costs 5 ms + 1 ms per robot (+ extra_ms) on the fake clock (or really sleeps); 4 ms of it decode."""

    decode_steps = STEPS
    action_names = ("x", "y", "z", "roll", "pitch", "yaw", "gripper")

    def __init__(self, clock=None, base_ms=5.0, per_robot_ms=1.0):
        self.clock, self.base_ms, self.per_robot_ms = clock, base_ms, per_robot_ms
        self.robots: set = set()
        self.batches: list[dict] = []  # per pass: name -> frame id
        self.extra_ms = 0.0
        self.fail_robot: dict = {}  # name -> exception returned for that robot
        self.raise_next = None  # exception raised by the next run_batch
        self.poison = False  # a raising pass leaves the state bad (needs_reset)
        self.swap = False  # a buggy engine returning each robot the other's result
        self.during_pass = None  # called inside run_batch (a ROS callback landing mid-pass)
        self.needs_reset = False
        self.resets = 0
        self.fail_add: set = set()
        self.bad_timing = False
        self.encode_ms = 0.0  # host time per encoded frame (on the fake clock)
        self.last_batch_timing: dict = {}

    def _spend(self, ms):
        if self.clock is None:
            time.sleep(ms / 1e3)
        else:
            self.clock.advance_ms(ms)

    def add_robot(self, name):
        if name in self.fail_add:
            raise MemoryError(f"no KV cache left for {name}")
        assert name not in self.robots
        self.robots.add(name)

    def remove_robot(self, name):
        self.robots.remove(name)

    def encode_frame(self, image):
        if self.encode_ms:
            self._spend(self.encode_ms)
        image = np.asarray(image)
        if image.ndim != 3 or image.shape[2] != 3:
            raise ValueError(f"image must be (H, W, 3), got {image.shape}")
        return image[:4, :2, :].reshape(4, 6).astype(np.float32) + 1.0

    def run_batch(self, requests):
        assert set(requests) <= self.robots, "a request for a robot the engine does not serve"
        self.batches.append({n: r.frame_id for n, r in requests.items()})
        if self.during_pass is not None:
            self.during_pass()
        cost = self.base_ms + self.per_robot_ms * len(requests) + self.extra_ms
        self._spend(cost)
        self.last_batch_timing = {"prefill_ms": cost - DECODE_MS, "decode_ms": DECODE_MS}
        if self.bad_timing:
            self.last_batch_timing = {"prefill_ms": float("nan")}
        if self.raise_next is not None:
            exc, self.raise_next = self.raise_next, None
            self.needs_reset = self.poison
            raise exc
        out = {}
        for name, req in requests.items():
            if name in self.fail_robot:
                out[name] = self.fail_robot[name]
                continue
            res = ChunkResult(frame_id=req.frame_id, token_ids=np.zeros(STEPS + 1, np.int64),
                              action_bins=np.zeros(7, np.int64), action=np.full(7, req.frame_id, np.float32),
                              prefill_ms=cost - DECODE_MS, decode_ms=DECODE_MS, total_ms=cost)
            res.robot = name
            out[name] = res
        if self.swap and len(out) == 2:
            a, b = list(out)
            out = {a: out[b], b: out[a]}
        return out

    def reset(self):
        self.resets += 1
        self.needs_reset = False


def harness(names=("a", "b", "c"), max_batch=4, deadline_ms=30.0, period_ms=33.0, clock=None, **kw):
    clock = FakeClock() if clock is None else clock
    engine = FakeBatchEngine(None if clock is time.monotonic_ns else clock)
    sched = FleetScheduler(max_batch, safety_margin_ms=2.0, decode_steps=STEPS)
    h = SimpleNamespace(clock=clock, engine=engine, sched=sched, got=[], events=[], buffers={})
    h.loop = FleetLoop(engine, sched, period_ms, deadline_ms, on_action=lambda n, r: h.got.append((n, r)),
                       on_event=lambda n, k, d: h.events.append((n, k, d)), clock_ns=clock, **kw)
    for n in names:
        add(h, n)
    return h


def add(h, name):
    h.buffers[name] = DoubleBuffer()
    h.loop.add_robot(name, h.buffers[name])


def cycle(h, frames=None):
    """Write ``frames`` (name -> frame id or Frame), jump to the next cycle boundary and serve that cycle."""
    for name, f in (frames or {}).items():
        h.buffers[name].write(frame(f) if isinstance(f, int) else f)
    h.got.clear()
    h.clock.t = h.loop.clock.next_deadline(h.clock.t)
    return h.loop.run_cycle(h.clock())


def robot(h, name):
    return h.loop.stats()["robots"][name]
