"""`vla_sim`: a MetaWorld arm behind ROS 2 topics, for closed-loop runs of the runtime (issue 21).

What it does, all in wall-clock time and never waiting for the policy:
- renders the fixed camera at ``camera_hz`` (its own timer, or with ``camera_after_control`` right after every
  k-th control step, k = control_hz / camera_hz: each frame then shows what the last action did) and publishes it as sensor_msgs/Image rgb8 on ``sim_camera_topic``
  (sensor-data QoS as the test camera offers it), stamped with the time the scene was captured;
- subscribes ``sim_action_topic`` (sensor_msgs/JointState from vla_action: names = the action dimensions, kind in
  header.frame_id) and offers every message to the episode controller, which validates it (a wrong length,
  other names, NaN/inf or an unknown kind is rejected and counted, and the sim holds) -- see sim/episode.py;
- at ``control_hz`` applies the NEWEST accepted action for one env step (sim/action_map.py: x y z metres ->
  MetaWorld units, gripper 1 = open; roll pitch yaw are not applied; hold = zero motion, gripper unchanged);
  when the publisher is late the robot does what it last sent (a 'repeat' is applied like the fresh action it
  repeats), and when nothing arrived for ``action_timeout_ms`` the sim holds by itself;
- ends an episode at success or after ``horizon`` steps, publishes its result as JSON (std_msgs/String) on
  ``episode_result_topic``, appends it to ``results_path`` (JSON lines), and resets from seed ``seed_start + k``;
  after ``num_episodes`` episodes (0 = forever) the process exits 0.

Threads: one SingleThreadedExecutor in its own thread (the house rule), so the camera timer and the control
timer run in one thread and never touch the MuJoCo state at the same time. A render (~37 ms on the 2-core CPU
machine, Mesa EGL, 96x96) can therefore delay a control tick by up to that much: at 10 Hz camera + 10 Hz control
the thread is ~45 % busy and the control period error is in every episode result (``extra``). The EGL context
is created and released in that thread (GL contexts are current per thread).

Episode video: with ``video_path`` set, episode ``video_episode`` is recorded (sim/episode_video.py): at each
of its control steps the newest image the camera timer already rendered and published (nothing is rendered
twice), the kind the step applied (fresh / repeat / hold, or the sim's own hold and its reason) and the applied
7-dim action; at the episode's end the GIF is written in a thread of its own (so the next episode's control ticks
are not delayed by the encoding) and its path logged. At exit the node waits for that thread, and an episode
still being recorded when the node is stopped is written as unfinished. The figures are in ``--stats-out``.

Baselines: ``sim_policy`` = 'expert' (the benchmark's scripted expert) or 'hold' (always hold) drive the arm from
inside the node, through the same gate, 7 -> 4 mapping and control timer as received actions (sim/episode.py
BuiltinDriver); the action topic is then not subscribed. 'external' (the default) applies received actions.

Parameters: the ``vla_sim`` rows of the registry (vla_edge_ros/params.py);
all read-only while running. ``--ros-args --params-file FILE`` / ``-p name:=value`` as for the other nodes.
"""
from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import rclpy
from rclpy.executors import SingleThreadedExecutor
from rclpy.node import Node
from rclpy.signals import SignalHandlerOptions
from rclpy.utilities import remove_ros_args
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import String

from vla_edge_ros import params as registry
from vla_edge_ros.core.metrics import LatencyStats, PeriodTracker
from vla_edge_ros.ros import conversions, qos
from vla_edge_ros.ros.param_bridge import ParameterRejected, descriptor_for


def sim_param_specs() -> tuple[registry.ParamSpec, ...]:
    return registry.for_node(registry.SIM)


def camera_steps_per_frame(control_hz: float, camera_hz: float) -> int:
    """k for camera_after_control: control steps per camera frame, control_hz / camera_hz as an integer >= 1;
    ValueError naming both rates otherwise (a phase-locked camera cannot run faster than the steps, nor at a
    fraction of them)."""
    k = control_hz / camera_hz
    if k < 1.0 - 1e-6 or abs(k - round(k)) > 1e-6:
        raise ValueError(f"camera_after_control needs control_hz / camera_hz to be an integer >= 1, got "
                         f"control_hz {control_hz:g} / camera_hz {camera_hz:g} = {k:g}")
    return int(round(k))


class SimNode(Node):
    NODE_NAME = registry.SIM

    def __init__(self, **node_kwargs):
        super().__init__(self.NODE_NAME, **node_kwargs)
        self.values = self._declare_parameters()
        v = self.values
        # metaworld / mujoco are the optional 'sim' extra: imported here so `--help` and the parameter docs work
        # without them.
        from vla_edge_ros.sim.episode import BuiltinDriver, SimController
        from vla_edge_ros.sim.metaworld_env import MetaWorldSim

        self.sim = MetaWorldSim(v["task"], v["camera_name"], v["image_width"], v["image_height"], v["horizon"],
                                v["render_shadows"])
        self.done = threading.Event()
        self.results_path = Path(v["results_path"]) if v["results_path"] else None
        if self.results_path is not None:
            self.results_path.parent.mkdir(parents=True, exist_ok=True)
        self.render_ms, self.step_ms = LatencyStats(4096), LatencyStats(4096)
        self.control_period = PeriodTracker(1000.0 / v["control_hz"])
        self.camera_period = PeriodTracker(1000.0 / v["camera_hz"])
        self.first_render_ms: Optional[float] = None
        self._ep_render_ms = LatencyStats(4096)
        self.frames_published = 0
        self.publish_errors = 0
        self.last_result: Optional[dict[str, Any]] = None
        self._image_pub = self.create_publisher(Image, v["sim_camera_topic"], qos.camera_publisher_qos())
        self._result_pub = self.create_publisher(String, v["episode_result_topic"], qos.reliable_qos(100))
        self.controller = SimController(self.sim, v["seed_start"], v["num_episodes"], v["action_timeout_ms"],
                                        on_result=self._on_result, wait_for_action=v["wait_for_action"],
                                        control_period_s=1.0 / v["control_hz"])
        self._episode_period = PeriodTracker(1000.0 / v["control_hz"])
        expert_action7 = None
        if v["sim_policy"] == "expert":
            from vla_edge_ros.sim.expert import ScriptedExpert

            expert_action7 = ScriptedExpert(self.sim).action7
        self._last_cmd7: Optional[tuple[float, ...]] = None  # the newest accepted command (the video's action)
        if expert_action7 is not None:
            expert_action7 = self._noting_command(expert_action7)
        self.driver = BuiltinDriver(self.controller, v["sim_policy"], expert_action7)
        self._video_wanted = bool(v["video_path"])
        self._video = None  # sim/episode_video.EpisodeVideo of the episode being recorded
        self._video_done = False  # recorded and handed to the writer (one episode per run)
        self._video_thread: Optional[threading.Thread] = None
        self._newest_frame = None  # the newest published image (the video's frame for the next control step)
        self.video_info: dict[str, Any] = {"path": v["video_path"] or None, "episode": v["video_episode"],
                                           "written": False, "steps_without_frame": 0, "error": None}
        self._action_sub = None  # a baseline drives: received actions must not mix in
        if not self.driver.drives:
            self._action_sub = self.create_subscription(JointState, v["sim_action_topic"], self._on_action,
                                                        qos.reliable_qos())
        # camera_after_control: a frame every k-th control step, right after it (phase-locked: the frame shows
        # the state the last action produced, as the synchronous loop's frames do); else a timer of its own,
        # whose phase against the control timer is whatever the start gave (created first: it fires just
        # before the control step, so its frame misses that step's motion).
        self._camera_every = camera_steps_per_frame(v["control_hz"], v["camera_hz"]) if v["camera_after_control"] \
            else 0
        self._control_ticks = 0
        self._camera_timer = (None if self._camera_every else
                              self.create_timer(1.0 / v["camera_hz"], self._on_camera))
        self._control_timer = self.create_timer(1.0 / v["control_hz"], self._on_control)
        self.get_logger().info(
            f"task {v['task']!r} ('{self.sim.instruction}'), camera {v['camera_name']} "
            f"{v['image_width']}x{v['image_height']} at {v['camera_hz']} Hz on {v['sim_camera_topic']}, control "
            f"{v['control_hz']} Hz from {v['sim_action_topic']}, horizon {v['horizon']}, seeds from "
            f"{v['seed_start']}, episodes {v['num_episodes'] or 'forever'}"
            + (f"; recording episode {v['video_episode']} to {v['video_path']}" if self._video_wanted else "")
            + (f"; sim_policy {v['sim_policy']!r}: the built-in baseline drives, {v['sim_action_topic']} is not "
               "subscribed" if self.driver.drives else
               ", waiting for the first action" if v["wait_for_action"] else ""))

    def _declare_parameters(self) -> dict[str, Any]:
        values = {}
        for spec in sim_param_specs():
            values[spec.name] = self.declare_parameter(spec.name, spec.default, descriptor_for(spec)).value
        reasons = [why for spec in sim_param_specs() if (why := spec.validate(values[spec.name]))]
        if reasons:
            raise ParameterRejected(self.get_name(), reasons)
        return values

    def _noting_command(self, action7):
        def noted():
            a = action7()
            self._last_cmd7 = tuple(float(x) for x in a)
            return a
        return noted

    # ---- callbacks (one executor thread) -----------------------------------------------------------------
    def _on_action(self, msg: JointState) -> None:
        reason = self.controller.offer(msg.header.frame_id, msg.position, msg.name,
                                       source_ns=conversions.stamp_to_ns(msg.header.stamp))
        if reason is None:
            self._last_cmd7 = tuple(float(x) for x in msg.position)
        else:
            self.get_logger().warning(f"action rejected ({self.controller.last_rejection}); the sim holds",
                                      throttle_duration_sec=1.0)

    def _on_camera(self) -> None:
        if self.done.is_set():
            return
        self.camera_period.tick()
        stamp_ns = self.get_clock().now().nanoseconds  # the scene as of now: render reads the current state
        t0 = time.perf_counter_ns()
        try:
            img = self.sim.render()
            ms = (time.perf_counter_ns() - t0) / 1e6
            if self.first_render_ms is None:  # the GL context is created here: ~0.8 s once, not a frame cost
                self.first_render_ms = ms
            else:
                self.render_ms.add(ms)
                self._ep_render_ms.add(ms)
            self._image_pub.publish(conversions.rgb_to_image_msg(img, "rgb8", stamp_ns, "sim_camera"))
        except Exception as exc:  # a failed frame must not stop the timer; it is counted and logged
            self.publish_errors += 1
            self.get_logger().error(f"camera frame failed: {exc!r}", throttle_duration_sec=1.0)
            return
        self.frames_published += 1
        if self._video_wanted:
            self._newest_frame = img
        self.controller.note_frame()

    def _on_control(self) -> None:
        if self.done.is_set():
            return
        now = time.monotonic_ns()
        if self.driver.offer(now) is not None:  # a baseline's command failed the gate: counted, the sim holds
            self.get_logger().error(f"{self.driver.policy} action rejected ({self.controller.last_rejection})",
                                    throttle_duration_sec=1.0)
        if not self.controller.started:
            self._camera_after_control()  # the runtime needs frames to send its first action
            return
        self.control_period.tick(now)
        self._episode_period.tick(now)
        cur = self.controller.current
        video = self._video_for(cur)
        before = _kind_counts(cur) if video is not None else None
        t0 = time.perf_counter_ns()
        self.controller.control_step(now)  # an episode that ends here is reported through _on_result
        self.step_ms.add((time.perf_counter_ns() - t0) / 1e6)
        if video is not None:
            self._record_step(video, cur, before)
        if self.controller.finished:
            self.done.set()
            return
        self._camera_after_control()

    def _camera_after_control(self) -> None:
        if self._camera_every:
            self._control_ticks += 1
            if self._control_ticks % self._camera_every == 0:
                self._on_camera()

    def _on_result(self, result) -> None:
        per = self._episode_period.summary()
        result.extra = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in {
                        "sim_policy": self.values["sim_policy"],
                        "control_hz": self.values["control_hz"], "camera_hz": self.values["camera_hz"],
                        "control_period_error_p99_ms": per["period_error_p99_ms"],
                        "control_longest_gap_ms": per["longest_gap_ms"],
                        "render_ms_p50": self._ep_render_ms.p50, "render_ms_p99": self._ep_render_ms.p99}.items()}
        self._episode_period = PeriodTracker(1000.0 / self.values["control_hz"])
        self._ep_render_ms = LatencyStats(4096)
        line = result.to_json()
        self.last_result = json.loads(line)
        if self.results_path is not None:
            with open(self.results_path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
        self._result_pub.publish(String(data=line))
        s = self.controller.summary()
        self.get_logger().info(f"episode {result.episode} seed {result.seed}: {result.end} after {result.steps} "
                               f"steps ({result.duration_s:.1f} s; fresh {result.fresh} repeat {result.repeat} "
                               f"hold {result.hold} sim-hold {sum(result.sim_hold.values())}); "
                               f"{s['successes']}/{s['episodes']} succeeded")

    # ---- the episode video ------------------------------------------------------------------------------
    def _video_for(self, cur):
        """The recorder of the running episode when it is the one to record (created at its first step)."""
        if not self._video_wanted or self._video_done or cur.episode != self.values["video_episode"]:
            return None
        if self._video is None:
            from vla_edge_ros.sim.episode_video import EpisodeVideo

            self._video = EpisodeVideo(cur.task, cur.horizon, self.values["control_hz"],
                                       self.values["video_max_frames"])
        return self._video

    def _record_step(self, video, cur, before) -> None:
        try:
            kind = _applied_kind(before, _kind_counts(cur))
            if self._newest_frame is None:  # no image published yet: the step is counted, not drawn
                self.video_info["steps_without_frame"] += 1
            else:
                video.add(self._newest_frame, kind, cur.steps,
                          self._last_cmd7 if kind in ("fresh", "repeat") else None)
        except ValueError as exc:  # the video stops (logged, in the stats), the episode goes on
            self._abandon_video(f"step {cur.steps} not recorded: {exc}")
            return
        if cur.end:  # the step ended the episode
            video.finish(cur.success, cur.steps, cur.end)
            self._start_video_writer()

    def _abandon_video(self, why: str) -> None:
        self.video_info["error"] = why
        self._video, self._video_done = None, True
        self.get_logger().error(f"episode video abandoned: {why}")

    def _start_video_writer(self) -> None:
        video, self._video, self._video_done = self._video, None, True
        self._video_thread = threading.Thread(target=self._write_video, args=(video,), name="vla_sim:video")
        self._video_thread.start()

    def _write_video(self, video) -> None:
        try:
            info = video.write_gif(self.values["video_path"])
        except Exception as exc:  # a failed video must not fail the run: logged, in the stats
            self.video_info["error"] = f"writing {self.values['video_path']} failed: {exc!r}"
            self.get_logger().error(self.video_info["error"])
            return
        self.video_info.update(info, written=True, result=video.result_text())
        self.get_logger().info(f"episode video: wrote {info['path']} ({info['frames']} frames of "
                               f"{info['width']}x{info['height']}, {info['bytes'] / 1024:.0f} KiB, every "
                               f"{info['stride']} of {info['steps_seen']} steps; {video.result_text()})")

    def finish_video(self, timeout_s: float = 120.0) -> None:
        """At exit, after the executor stopped: write an episode still being recorded (as unfinished) and wait
        for the writer."""
        if self._video is not None and self._video.frame_count:
            self._start_video_writer()
        if self._video_thread is not None:
            self._video_thread.join(timeout_s)
            if self._video_thread.is_alive():
                self.video_info["error"] = f"the video writer did not finish in {timeout_s:.0f} s"
                self.get_logger().error(self.video_info["error"])

    def close_sim(self) -> None:
        """Release the renderer; call from the executor thread (it owns the GL context)."""
        self.sim.close()

    def snapshot(self) -> dict[str, Any]:
        return {"episodes": self.controller.summary(), "frames_published": self.frames_published,
                "camera": ({"mode": "after_control", "control_steps_per_frame": self._camera_every}
                           if self._camera_every else {"mode": "timer"}),
                "publish_errors": self.publish_errors, "first_render_ms": self.first_render_ms,
                "render_ms": self.render_ms.summary(),
                "control_step_ms": self.step_ms.summary(), "control_period": self.control_period.summary(),
                "camera_period": self.camera_period.summary(), "video": dict(self.video_info)}


def _kind_counts(cur) -> dict[str, int]:
    return {"fresh": cur.fresh, "repeat": cur.repeat, "hold": cur.hold, **cur.sim_hold}


def _applied_kind(before: dict[str, int], after: dict[str, int]) -> str:
    """The kind one control step applied: the one counter of the episode result it incremented."""
    changed = [k for k in after if after[k] != before.get(k, 0)]
    if len(changed) != 1:
        raise ValueError(f"the step changed the kind counters {changed or 'none'}, expected exactly one")
    return changed[0]


def main(args=None) -> int:
    argv = list(sys.argv if args is None else args)
    ap = argparse.ArgumentParser(prog="vla_sim", description=__doc__.split("\n")[0])
    ap.add_argument("--stats-out", default=None, help="write the node's figures as JSON here at exit")
    opts = ap.parse_args(remove_ros_args(argv)[1:])
    rclpy.init(args=argv, signal_handler_options=SignalHandlerOptions.NO)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        node = SimNode()
    except Exception as exc:
        print(f"vla_sim: cannot start: {exc}", file=sys.stderr)
        rclpy.try_shutdown()
        return 2
    ex = SingleThreadedExecutor()
    ex.add_node(node)

    failed = []

    def spin() -> None:
        try:
            ex.spin()
        except Exception as exc:  # a callback raised (or the context was shut down under us): stop, exit 1
            if rclpy.ok():
                failed.append(exc)
                print(f"vla_sim: executor stopped: {exc!r}", file=sys.stderr)
        finally:
            node.close_sim()
            node.done.set()

    th = threading.Thread(target=spin, name="exec:vla_sim", daemon=True)
    th.start()
    while not (stop.is_set() or node.done.is_set()):
        stop.wait(0.2)
    ex.shutdown(timeout_sec=2.0)
    th.join(timeout=5.0)
    node.finish_video()
    stats = node.snapshot()
    node.get_logger().info(f"exit: {json.dumps(stats['episodes'])}, {node.frames_published} frames")
    if opts.stats_out:
        Path(opts.stats_out).write_text(json.dumps(stats, indent=2, default=str))
    node.destroy_node()
    rclpy.try_shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
