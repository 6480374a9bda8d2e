"""The one place every ROS parameter of vla_edge_ros is defined.

Each parameter has a name, type, default, range/choices, description, the node that owns it and whether it
may be changed live. Nodes declare their parameters from this table (ros/param_bridge.py turns a spec into
an rclpy ParameterDescriptor), config/runtime.yaml and the README table are checked against it by
test/test_params_registry.py, so the three cannot drift.

Durations are milliseconds as doubles (``deadline_ms: 33.0``). No rclpy import here: unit tests use it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from vla_edge_ros.sim.tasks import CAMERAS, DEFAULT_CAMERA, TASK_KEYS  # pure: no metaworld import

CAMERA = "vla_camera"
INFERENCE = "vla_inference"
ACTION = "vla_action"
SIM = "vla_sim"  # the simulated arm (ros/sim_node.py): not part of the runtime, shares the registry
NODES = (CAMERA, INFERENCE, ACTION, SIM)

EVICTION_POLICIES = ("semantic", "fifo", "sliding_window")
BACKENDS = ("auto", "cuda", "numpy")
IMAGE_TRANSPORTS = ("raw", "compressed")
CHUNK_MERGES = ("latest", "temporal_ensemble", "blend")  # core/executor.MERGES (a test keeps them equal)
WEIGHT_DTYPES = ("bf16", "int8", "fp8", "int4")  # engine/quant.WEIGHT_DTYPES (a test keeps them equal)
ACTION_READOUTS = ("argmax", "expectation")  # engine/geometry.ACTION_READOUTS (a test keeps them equal)

# kv_budget_tokens = 0 (the default) takes the backend's own budget. A KV cache the GPU attends over in
# ~1 ms per chunk costs the numpy backend far more on the 2-core CPU the README documents. Measured there
# (bench/demo.py, bench/sweep.py, docs/FIGURES.md): the tiny default's chunk p50 / p99 are ~27 / 78 ms with
# 4082 retained tokens (over the 31 ms budget: ~80 % holds, 17 % of admitted chunks late), ~21 / 30 ms at
# 1024 and 12.9 / 18.5 ms at ~560; 512 tokens (15 frames) leave the p99 well inside the budget on a busy
# machine. The GPU default is the one the H200 replay and benchmarks were measured with.
KV_BUDGET_BY_BACKEND = {"cuda": 4096, "numpy": 512}


@dataclass(frozen=True)
class ParamSpec:
    name: str
    type: type  # bool, int, float or str
    default: Any
    description: str
    node: str
    min: float | None = None
    max: float | None = None
    choices: tuple[str, ...] | None = None
    live: bool = False  # may be changed while the node runs (validated, applied at a defined point)
    applies: str = ""  # when a live change takes effect

    def validate(self, value: Any) -> str | None:
        """Return None when ``value`` is acceptable, else a human-readable reason."""
        if self.type is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if self.type is bool:
            ok = isinstance(value, bool)
        elif self.type is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif self.type is float:
            ok = isinstance(value, float)
        else:
            ok = isinstance(value, self.type)
        if not ok:
            return f"{self.name} must be of type {self.type.__name__}, got {type(value).__name__} ({value!r})"
        if self.type is float and value != value:  # NaN
            return f"{self.name} must be a number, got NaN"
        if self.min is not None and value < self.min:
            return f"{self.name}={value!r} is below the minimum {self.min}"
        if self.max is not None and value > self.max:
            return f"{self.name}={value!r} is above the maximum {self.max}"
        if self.choices is not None and value not in self.choices:
            return f"{self.name}={value!r} is not one of {', '.join(self.choices)}"
        return None


PARAMS: tuple[ParamSpec, ...] = (
    # ---- camera subscriber ------------------------------------------------------------------------------
    ParamSpec("camera_topic", str, "/camera/image_raw", "sensor_msgs/Image topic (sensor-data QoS); compressed: "
              "'<camera_topic>/compressed'",
              CAMERA),
    ParamSpec("image_transport", str, "raw", "raw: sensor_msgs/Image; compressed: sensor_msgs/CompressedImage "
              "(JPEG/PNG, decoded off the hot path)", CAMERA, choices=IMAGE_TRANSPORTS),
    ParamSpec("camera_deadline_ms", float, 100.0, "QoS deadline of the camera subscription: missing it marks "
              "the camera stalled", CAMERA, min=1.0, max=60000.0),
    ParamSpec("max_image_bytes", int, 33554432, "larger images are rejected (counted) before decoding",
              CAMERA, min=1, max=1 << 31),
    ParamSpec("frozen_frame_limit", int, 30, "identical frames in a row that flag a frozen camera (0 = off)",
              CAMERA, min=0, max=1000000, live=True, applies="next frame"),
    ParamSpec("hold_on_frozen", bool, False, "a frozen camera is stale (the robot holds)",
              CAMERA, live=True, applies="next frame"),
    # ---- inference ----------------------------------------------------------------------------------------
    ParamSpec("checkpoint", str, "", "HF-layout checkpoint directory (config.json + *.safetensors); empty = "
              "the tiny default", INFERENCE),
    ParamSpec("backend", str, "auto", "auto picks cuda when PyCUDA imports and a GPU is present, else numpy",
              INFERENCE, choices=BACKENDS),
    ParamSpec("instruction", str, "pick up the object", "language instruction, encoded as the pinned KV prefix",
              INFERENCE),
    ParamSpec("tokens_per_frame", int, 32, "vision tokens (KV slots) per camera frame", INFERENCE, min=1, max=1024),
    ParamSpec("decode_tokens", int, 8, "greedy decode steps per chunk: 7 bins + 1 end token (H steps: >= 7H + 1)",
              INFERENCE, min=1, max=64),
    ParamSpec("kv_budget_tokens", int, 0, "KV-cache tokens, prefix included; 0 = the backend's "
              "(cuda 4096, numpy 512)",
              INFERENCE, min=0, max=1 << 20, live=True, applies="at once (a shrink evicts)"),
    ParamSpec("eviction_policy", str, "semantic", "KV eviction policy", INFERENCE, choices=EVICTION_POLICIES,
              live=True, applies="next eviction"),
    ParamSpec("window_frames", int, 16, "frames kept by the sliding_window policy", INFERENCE, min=1,
              max=1 << 20, live=True, applies="next admitted frame"),
    ParamSpec("deadline_ms", float, 33.0, "control-cycle deadline a chunk must finish within", INFERENCE,
              min=1.0, max=10000.0, live=True, applies="next cycle"),
    ParamSpec("safety_margin_ms", float, 2.0, "admission keeps this much slack before the deadline", INFERENCE,
              min=0.0, max=10000.0, live=True, applies="next cycle"),
    ParamSpec("ema_alpha", float, 0.2, "smoothing of the prefill / per-token decode cost EMAs", INFERENCE,
              min=0.001, max=1.0, live=True, applies="next chunk"),
    ParamSpec("cost_quantile", float, 0.5, "quantile of the last 256 overruns added to the mean "
              "estimate (0: none)", INFERENCE, min=0.0, max=1.0, live=True,
              applies="next chunk"),
    ParamSpec("warmup_chunks", int, 3, "chunks run at configure time to seed the cost EMAs", INFERENCE,
              min=0, max=1000),
    ParamSpec("inference_thread_nice", int, 5, "nice increment of the inference thread (Linux; 0 = off)",
              INFERENCE, min=0, max=19),
    ParamSpec("max_vram_gb", float, 8.0, "refuse to start when model + KV budget + scratch exceed this",
              INFERENCE, min=0.01, max=1024.0),
    ParamSpec("weight_dtype", str, "bf16", "linear-layer weights (numpy and cuda)",
              INFERENCE, choices=WEIGHT_DTYPES),
    ParamSpec("saliency_threshold", float, 0.2, "cosine distance to the last frame (pooled) that makes a "
              "frame salient", INFERENCE, min=0.0, max=2.0, live=True,
              applies="next frame"),
    ParamSpec("fresh_action_topic", str, "/vla/action_fresh", "fresh actions (chunks) from the edge to the "
              "robot (split)", INFERENCE),
    ParamSpec("execution_horizon_steps", int, 0, "steps of an action chunk played before the next starts; "
              "0 = H/2", INFERENCE, min=0, max=4096, live=True, applies="next cycle"),
    ParamSpec("force_committed_steps", bool, False, "with chunk_merge blend: force-decode the committed steps (RTC)",
              INFERENCE),
    ParamSpec("action_readout", str, "argmax", "a slot's action: its likeliest bin, or the bins' softmax mean",
              INFERENCE, choices=ACTION_READOUTS),
    # ---- one edge serving a fleet (issue 24, ros/fleet_node.py; docs/OPERATIONS.md "One edge, many robots") --
    ParamSpec("robot_namespaces", str, "", "--role edge: robots served, comma-separated (r1,r2)",
              INFERENCE),
    ParamSpec("fleet_max_batch", int, 8, "robots per batched pass, at most", INFERENCE, min=1, max=64),
    ParamSpec("fleet_camera_process", bool, True, "fleet edge: cameras in a child process, off the loop's GIL",
              INFERENCE),
    ParamSpec("fleet_frame_bytes", int, 921600, "camera process: largest RGB frame (more: rejected)",
              INFERENCE, min=1024, max=1 << 30),
    ParamSpec("fleet_starvation_limit", int, 3, "capacity refusals before a robot goes first (0 off)",
              INFERENCE, min=0, max=1000),
    # ---- action publisher -------------------------------------------------------------------------------
    ParamSpec("action_rate_hz", float, 30.0, "rate of the action publisher timer", ACTION, min=1.0, max=1000.0,
              live=True, applies="next tick (timer re-created)"),
    ParamSpec("chunk_step_hz", float, 0.0, "rate of a chunk's steps (the policy's); 0: action_rate_hz", ACTION,
              min=0.0, max=1000.0),
    ParamSpec("stale_after_ms", float, 200.0, "hold (zero motion, gripper kept) once the newest frame or "
              "action is older", ACTION, min=1.0, max=600000.0, live=True, applies="next tick"),
    ParamSpec("action_topic", str, "/vla/action", "sensor_msgs/JointState published every tick", ACTION),
    ParamSpec("action_status_topic", str, "/vla/action_status", "per-tick DiagnosticStatus: kind, source stamp, age, "
              "sequence", ACTION),
    ParamSpec("chunk_merge", str, "latest", "merge of overlapping action chunks", ACTION, choices=CHUNK_MERGES),
    # docs/OPERATIONS.md "Action chunks": which steps, their times; published once per accepted chunk
    ParamSpec("action_trajectory_topic", str, "/vla/action_trajectory", "chunks as trajectory_msgs/JointTrajectory "
              "(empty = off)", ACTION),
    # ---- simulated arm (vla_sim; read-only: a changed task, rate or camera is a new run) ------------------
    # The sim's own topics are sim_camera_topic / sim_action_topic (names are unique across the registry); their
    # defaults are the runtime's camera_topic / action_topic, so the two meet without remapping.
    ParamSpec("task", str, "push", "simulated MetaWorld task (its instruction is in each episode result)", SIM,
              choices=TASK_KEYS),
    ParamSpec("camera_hz", float, 10.0, "rate of the rendered camera (10 Hz holds on 2 CPU cores: a 96x96 render "
              "costs ~37 ms there, ~0.7 ms on the H200)", SIM, min=0.1, max=1000.0),
    ParamSpec("control_hz", float, 10.0, "rate at which the newest received action is applied (one env step "
              "each, wall clock; the sim never waits for the policy)", SIM, min=0.1, max=1000.0),
    ParamSpec("camera_after_control", bool, False, "render the camera right after every k-th control step "
              "(k = control_hz / camera_hz, an integer) instead of on its own timer: each frame shows the state the "
              "last action produced", SIM),
    ParamSpec("image_width", int, 96, "rendered image width in pixels", SIM, min=8, max=2048),
    ParamSpec("image_height", int, 96, "rendered image height in pixels", SIM, min=8, max=2048),
    ParamSpec("camera_name", str, DEFAULT_CAMERA, "fixed MetaWorld camera rendered", SIM, choices=CAMERAS),
    ParamSpec("render_shadows", bool, False, "render shadows and reflections (~5x the render time on CPU)", SIM),
    ParamSpec("horizon", int, 200, "control steps after which an unsuccessful episode ends (the experts need "
              "37-79)", SIM, min=1, max=1000000),
    ParamSpec("seed_start", int, 0, "episode k starts from seed seed_start + k (an episode is replayed from its "
              "seed)", SIM, min=0, max=2147483647),
    ParamSpec("num_episodes", int, 0, "episodes to run before the node exits (0 = forever)", SIM, min=0,
              max=1000000000),
    ParamSpec("wait_for_action", bool, True, "start the first episode at the first accepted action (images are "
              "published meanwhile), so a slow runtime start-up does not use up an episode", SIM),
    ParamSpec("action_timeout_ms", float, 500.0, "the sim holds (zero motion, gripper unchanged) when the newest "
              "action was received longer ago than this", SIM, min=1.0, max=600000.0),
    ParamSpec("sim_camera_topic", str, "/camera/image_raw", "sensor_msgs/Image rgb8 published at camera_hz", SIM),
    ParamSpec("sim_action_topic", str, "/vla/action", "sensor_msgs/JointState actions (kind in header.frame_id) "
              "applied by the sim", SIM),
    ParamSpec("episode_result_topic", str, "/vla/episode_result", "std_msgs/String: one JSON episode result per "
              "finished episode", SIM),
    ParamSpec("results_path", str, "", "JSON lines file each episode result is appended to (empty = none)", SIM),
    ParamSpec("sim_policy", str, "external", "who drives the arm: external (the received actions), expert (the "
              "scripted expert, a baseline) or hold (always hold, a baseline); baselines go through the same "
              "mapping and control timing", SIM, choices=("external", "expert", "hold")),
    ParamSpec("video_path", str, "", "write episode video_episode as an animated GIF here: each control step's "
              "camera frame (the image already published, not rendered again) with the applied kind (fresh / "
              "repeat / hold) and the episode's result drawn on it (empty = no video; needs Pillow)", SIM),
    ParamSpec("video_episode", int, 0, "the episode (0, 1, ... within this run) that video_path records", SIM,
              min=0, max=1000000000),
    ParamSpec("video_max_frames", int, 240, "frames the episode video keeps at most: a longer episode is evenly "
              "subsampled (bounds the memory: 240 frames of 128x64 are 6 MiB)", SIM, min=2, max=100000),
)

BY_NAME: dict[str, ParamSpec] = {p.name: p for p in PARAMS}


def for_node(node: str) -> tuple[ParamSpec, ...]:
    return tuple(p for p in PARAMS if p.node == node)


def defaults(node: str | None = None) -> dict[str, Any]:
    return {p.name: p.default for p in PARAMS if node is None or p.node == node}


def validate(name: str, value: Any) -> str | None:
    spec = BY_NAME.get(name)
    if spec is None:
        return f"unknown parameter {name!r}"
    return spec.validate(value)


def resolve_kv_budget(budget: int, backend: str, tokens_per_frame: int = 1) -> int:
    """``kv_budget_tokens`` as the engine uses it: 0 is the backend's default (``KV_BUDGET_BY_BACKEND``),
    rounded down to whole frames."""
    if budget:
        return int(budget)
    if backend not in KV_BUDGET_BY_BACKEND:
        raise ValueError(f"no default kv_budget_tokens for backend {backend!r}")
    return KV_BUDGET_BY_BACKEND[backend] // tokens_per_frame * tokens_per_frame


def validate_combination(values: Mapping[str, Any], prefix_tokens: int = 0) -> list[str]:
    """Cross-parameter checks; ``values`` may hold any subset (missing names use defaults). A
    ``kv_budget_tokens`` of 0 is checked as every backend default it may resolve to."""
    v = {**defaults(), **values}
    reasons: list[str] = []
    tpf = v["tokens_per_frame"]
    budgets = sorted({resolve_kv_budget(v["kv_budget_tokens"], b, tpf) for b in KV_BUDGET_BY_BACKEND})
    for budget in budgets:
        reasons += _budget_reasons(budget, tpf, prefix_tokens)
    if v["safety_margin_ms"] >= v["deadline_ms"]:
        reasons.append(f"safety_margin_ms={v['safety_margin_ms']} leaves no time inside deadline_ms="
                       f"{v['deadline_ms']}")
    return reasons


def _budget_reasons(budget: int, tpf: int, prefix_tokens: int) -> list[str]:
    reasons: list[str] = []
    if budget % tpf != 0:
        reasons.append(f"kv_budget_tokens={budget} is not a multiple of tokens_per_frame={tpf}")
    if budget < prefix_tokens + tpf:
        reasons.append(f"kv_budget_tokens={budget} is smaller than the pinned prefix ({prefix_tokens} tokens) "
                       f"plus one frame ({tpf} tokens)")
    return reasons


def validate_all(values: Mapping[str, Any], prefix_tokens: int = 0) -> list[str]:
    reasons = [r for n, val in values.items() if (r := validate(n, val))]
    return reasons or validate_combination(values, prefix_tokens)
