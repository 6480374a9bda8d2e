"""`vla_bag_replay`: publish a ROS 2 bag's messages with their original timing (no ROS install needed).

    vla_bag_replay BAG [--rate R] [--camera-hz HZ] [--loop] [--start-offset S] [--decode] [--duration-s S]
                       [--wait-for TOPIC ...] [--stats-out FILE]          (BAG may also be given as --bag BAG)

For the runtime's default configuration (sensor_msgs/Image on /camera/image_raw, 100 ms camera deadline) replay
an OXE bag with ``--decode --camera-hz 60 --loop``.

The bag is read with rosbags (raw CDR, MCAP or sqlite3); each message is deserialized into its rclpy message
class with ``rclpy.serialization.deserialize_message`` and published on its original topic: camera frames,
``/vla/instruction``, ``/vla/recorded_action`` (so a benchmark can compare the runtime's actions with the
recorded ones) and ``/vla/episode_events``.

- ``rate``: time multiplier (2.0 = twice as fast).
- ``camera_hz`` > 0 re-times the camera: the newest bag frame is republished at this fixed rate with fresh
  stamps, emulating a fast camera in front of a slow dataset (Bridge is 5 Hz, the runtime expects ~60 Hz).
- ``decode``: CompressedImage frames are decoded once (Pillow) and published as sensor_msgs/Image rgb8 on the
  topic without ``/compressed``, which is what the runtime subscribes to by default (image_transport=raw).
- ``restamp`` (default on): header stamps are rewritten to the replay's clock (bag time mapped onto now), so
  the runtime's staleness checks see live data; frames and actions of one bag instant share one stamp.
- ``loop``, ``start_offset`` (seconds into the bag), ``duration_s`` (0 = until the bag ends).
- ``wait_for``: topics that must have a matched subscriber before playback starts (``wait_timeout_s``), so a
  consumer started at the same time (the runtime, a test) does not miss the beginning.

Bad bags: an unreadable bag (missing directory, missing or invalid ``metadata.yaml``, missing or corrupt data
file) is refused with one clear line on stderr and exit code 2, never a traceback. An MCAP file cut short (a
recorder killed before writing its footer, a copy truncated) is replayed up to its last complete record and the
loss is reported. A message that cannot be deserialized or decoded (corrupt bytes) is skipped and counted per
topic, and a read error in the middle of playback ends the replay with what was read so far. Exit code 0: the
whole bag was replayed; 3: a partial replay (prefix of a truncated file, skipped messages or a read error; the
``--stats-out`` summary and the log say what was skipped); 2: nothing could be replayed.

Every option is also a ROS parameter (``--ros-args -p camera_hz:=60.0``); the command-line flags give the
parameters' defaults. Camera topics use the camera publisher QoS of ros/qos.py (best effort, keep last 1, with
a deadline, so they match the runtime's camera subscription); ``/vla/instruction`` is reliable +
transient-local (a late subscriber still gets it); the rest is reliable.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import rclpy
from rclpy.executors import SingleThreadedExecutor
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
from rclpy.serialization import deserialize_message
from rclpy.signals import SignalHandlerOptions
from rclpy.utilities import remove_ros_args

from vla_edge_ros.ros import conversions, qos
from vla_edge_ros.ros.tools.bag_sources import (EXIT_OK, EXIT_PARTIAL, EXIT_UNREADABLE, BagError,  # noqa: F401
                                                McapPrefixSource, RosbagsSource, decode_jpeg, message_class,
                                                open_bag)

IMAGE_TYPES = ("sensor_msgs/msg/Image", "sensor_msgs/msg/CompressedImage")
COMPRESSED_SUFFIX = "/compressed"
LATE_MS = 5.0  # a message published more than this after its due time counts as late
LINGER_S = 0.5  # stay up this long after the last message before destroying the publishers
TEARDOWN_S = 8.0  # the most rclpy's teardown may take after the summary (fleet_replay waits 15 s for a replay)



class BagReplay(Node):
    def __init__(self, defaults: Optional[dict] = None, **kw):
        super().__init__("vla_bag_replay", **kw)
        d = {"bag": "", "rate": 1.0, "camera_hz": 0.0, "loop": False, "start_offset": 0.0, "decode": False,
             "restamp": True, "duration_s": 0.0, "camera_deadline_ms": 50.0, "wait_for": [""],
             "wait_timeout_s": 10.0, **(defaults or {})}
        for name, value in d.items():
            self.declare_parameter(name, value)
        g = lambda n: self.get_parameter(n).value  # noqa: E731
        self.bag = str(g("bag"))
        self.rate, self.camera_hz = float(g("rate")), float(g("camera_hz"))
        self.loop, self.start_offset = bool(g("loop")), float(g("start_offset"))
        self.decode, self.restamp = bool(g("decode")), bool(g("restamp"))
        self.duration_s, self.camera_deadline_ms = float(g("duration_s")), float(g("camera_deadline_ms"))
        self.wait_for = [t for t in g("wait_for") if t]
        self.wait_timeout_s = float(g("wait_timeout_s"))
        if not self.bag:
            raise ValueError("no bag given (positional BAG or -p bag:=PATH)")
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")
        if self.camera_hz < 0 or self.start_offset < 0 or self.duration_s < 0:
            raise ValueError("camera_hz, start_offset and duration_s must be >= 0")
        self.counts: dict[str, int] = {}
        self.skipped_topics: dict[str, str] = {}
        self.skipped_messages: dict[str, int] = {}  # topic -> messages not replayed (corrupt / undecodable)
        self.skip_reasons: dict[str, str] = {}  # topic -> the first reason
        self.read_error = ""  # the bag could not be read further (playback ended early)
        self.bag_note = ""  # what the reader could not recover (truncated file)
        self.camera_ticks = 0
        self.late = 0
        self.max_lag_ms = 0.0
        self.passes = 0
        self.done = threading.Event()
        self._stop = threading.Event()
        self._pubs: dict[str, object] = {}
        self._latest_frame = None  # (topic, msg) for camera re-timing
        self._setup_topics()
        self.get_logger().info(
            f"replaying {self.bag} at x{self.rate:g}" + (f", camera re-timed to {self.camera_hz:g} Hz"
                                                         if self.camera_hz else "")
            + (", decoding JPEG to rgb8" if self.decode else "") + (", looping" if self.loop else ""))

    # ---- topics -----------------------------------------------------------------------------------------
    def _setup_topics(self) -> None:
        self._plan: dict[str, tuple] = {}  # bag topic -> (out topic, class, kind) kind: image|decode|plain
        source = open_bag(self.bag)
        try:
            self.bag_start_ns, self.bag_end_ns = source.start_time, source.end_time
            self.bag_note = source.note
            topics = list(source.topics)
        finally:
            source.close()
        if self.bag_note:
            self.get_logger().warning(self.bag_note)
        for topic, msgtype in topics:
            if topic in self._plan:
                continue
            cls = message_class(msgtype)
            if cls is None:
                self.skipped_topics[topic] = f"message type {msgtype} not installed"
                continue
            if msgtype in IMAGE_TYPES:
                if self.decode and msgtype.endswith("CompressedImage"):
                    out = topic[:-len(COMPRESSED_SUFFIX)] if topic.endswith(COMPRESSED_SUFFIX) \
                        else topic + "/decoded"
                    from sensor_msgs.msg import Image

                    self._plan[topic] = (out, cls, "decode")
                    self._publisher(out, Image, qos.camera_publisher_qos(self.camera_deadline_ms))
                else:
                    self._plan[topic] = (topic, cls, "image")
                    self._publisher(topic, cls, qos.camera_publisher_qos(self.camera_deadline_ms))
            else:
                self._plan[topic] = (topic, cls, "plain")
                if topic == "/vla/instruction":
                    profile = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1,
                                         reliability=ReliabilityPolicy.RELIABLE,
                                         durability=DurabilityPolicy.TRANSIENT_LOCAL)
                else:
                    profile = qos.reliable_qos(depth=50)
                self._publisher(topic, cls, profile)
        for topic, why in self.skipped_topics.items():
            self.get_logger().warning(f"topic {topic} not replayed: {why}")

    def wait_for_subscribers(self) -> list[str]:
        """Block until every ``wait_for`` topic has a matched subscriber (or the timeout); returns the topics
        still unmatched. Lets a test or the sweep start the replay before its consumers are discovered."""
        unknown = [t for t in self.wait_for if t not in self._pubs]
        if unknown:
            raise ValueError(f"wait_for names topics this bag does not publish: {', '.join(unknown)}; "
                             f"published: {', '.join(sorted(self._pubs))}")
        t_end = time.monotonic() + self.wait_timeout_s
        while not self._stop.is_set():
            missing = [t for t in self.wait_for if self._pubs[t].get_subscription_count() == 0]
            if not missing or time.monotonic() >= t_end:
                if missing:
                    self.get_logger().warning(f"no subscriber on {', '.join(missing)} after "
                                              f"{self.wait_timeout_s:g} s; replaying anyway")
                else:
                    self._stop.wait(0.3)  # both ends see the match; give the subscriber side a moment
                return missing
            self._stop.wait(0.05)
        return []

    def _publisher(self, topic: str, cls, profile) -> None:
        if topic not in self._pubs:
            self._pubs[topic] = self.create_publisher(cls, topic, profile)

    # ---- playback --------------------------------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()

    def _publish(self, topic: str, msg, stamp_ns: Optional[int]) -> None:
        if stamp_ns is not None and hasattr(msg, "header"):
            msg.header.stamp = conversions.ns_to_stamp(stamp_ns)
        self._pubs[topic].publish(msg)
        self.counts[topic] = self.counts.get(topic, 0) + 1

    def _wait_until(self, target: float, next_tick: list) -> bool:
        """Sleep until monotonic ``target``, publishing camera ticks on the way; False when stopped."""
        while True:
            now = time.monotonic()
            if self._stop.is_set() or (self._deadline is not None and now >= self._deadline):
                return False
            if self.camera_hz > 0 and next_tick[0] <= min(now, target):
                self._camera_tick(now)
                period = 1.0 / self.camera_hz
                next_tick[0] += period
                if next_tick[0] < now - period:  # fell far behind (a long stall): do not burst
                    next_tick[0] = now + period
                continue
            if now >= target:
                return True
            wake = target if self.camera_hz <= 0 else min(target, next_tick[0])
            self._stop.wait(max(0.0, wake - now))

    def _camera_tick(self, now: float) -> None:
        if self._latest_frame is None:
            return
        topic, msg = self._latest_frame
        self._publish(topic, msg, self.get_clock().now().nanoseconds)
        self.camera_ticks += 1

    def _skip(self, topic: str, reason: str) -> None:
        n = self.skipped_messages.get(topic, 0) + 1
        self.skipped_messages[topic] = n
        self.skip_reasons.setdefault(topic, reason)
        if n == 1 or n % 100 == 0:  # a bag full of bad messages must not flood the log
            self.get_logger().warning(f"message on {topic} skipped ({n} so far on this topic): {reason}")

    def run(self) -> None:
        """Playback loop (its own thread); sets ``done`` when the bag (or duration) ends, on stop() or when the
        bag cannot be read further (``read_error``). Never raises: a bad message is skipped and counted."""
        try:
            if self.wait_for:
                self.wait_for_subscribers()
            self._deadline = time.monotonic() + self.duration_s if self.duration_s > 0 else None
            next_tick = [time.monotonic()]
            while not self._stop.is_set():
                if not self._play_once(next_tick):
                    return
                self.passes += 1
                if not self.loop:
                    return
        except Exception as exc:  # a bug or an unexpected reader failure: report it, end the replay cleanly
            self.read_error = self.read_error or f"{type(exc).__name__}: {exc}"
            self.get_logger().error(f"replay stopped: {self.read_error}")
        finally:
            self.done.set()

    def _play_once(self, next_tick: list) -> bool:
        """One pass over the bag; False when playback must end (stopped, duration over, nothing to play, or
        the bag could not be read further)."""
        first_ns = self.bag_start_ns + int(self.start_offset * 1e9)
        base_wall = base_ros = None
        source = open_bag(self.bag)
        try:
            messages = source.messages(set(self._plan), first_ns)
            while True:
                try:
                    item = next(messages, None)
                except Exception as exc:  # corrupt data past this point: keep what was replayed
                    self.read_error = (f"bag unreadable after {sum(self.counts.values())} published messages: "
                                       f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                    self.get_logger().error(self.read_error)
                    return False
                if item is None:
                    break
                topic, t_ns, raw = item
                if base_wall is None:
                    base_wall, base_ros = time.monotonic(), self.get_clock().now().nanoseconds
                    first_ns = t_ns
                rel_s = (t_ns - first_ns) / 1e9 / self.rate
                target = base_wall + rel_s
                if not self._wait_until(target, next_tick):
                    return False
                lag_ms = (time.monotonic() - target) * 1e3
                self.max_lag_ms = max(self.max_lag_ms, lag_ms)
                self.late += lag_ms > LATE_MS
                out, cls, kind = self._plan[topic]
                stamp = base_ros + int(rel_s * 1e9) if self.restamp else None
                try:
                    msg = deserialize_message(bytes(raw), cls)
                    if kind == "decode":
                        rgb = decode_jpeg(msg.data)
                        msg = conversions.rgb_to_image_msg(rgb, "rgb8", stamp if stamp is not None else
                                                           conversions.stamp_to_ns(msg.header.stamp),
                                                           msg.header.frame_id or "camera")
                        stamp = None  # already stamped
                except Exception as exc:  # corrupt bytes in this message: skip it, count it, go on
                    self._skip(topic, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                    continue
                if kind in ("image", "decode") and self.camera_hz > 0:
                    self._latest_frame = (out, msg)  # the fixed-rate camera tick publishes it
                    self.counts[f"{out} (bag frames)"] = self.counts.get(f"{out} (bag frames)", 0) + 1
                    continue
                self._publish(out, msg, stamp)
        finally:
            source.close()
        if base_wall is None:
            self.get_logger().warning(f"no message after start offset {self.start_offset} s")
            return False
        return True

    @property
    def partial(self) -> bool:
        """Something in the bag was not replayed (truncated file, skipped messages, read error)."""
        return bool(self.bag_note or self.skipped_messages or self.read_error)

    def summary(self) -> dict:
        return {"bag": self.bag, "passes": self.passes, "published": dict(self.counts),
                "camera_ticks": self.camera_ticks, "late_messages": self.late,
                "max_lag_ms": round(self.max_lag_ms, 3), "skipped_topics": dict(self.skipped_topics),
                "skipped_messages": dict(self.skipped_messages), "skip_reasons": dict(self.skip_reasons),
                "read_error": self.read_error, "bag_note": self.bag_note, "complete": not self.partial}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vla_bag_replay", description=__doc__.split("\n")[0])
    ap.add_argument("bag_path", nargs="?", default="", metavar="BAG", help="bag directory (or --bag / -p bag:=PATH)")
    ap.add_argument("--bag", default="", help="bag directory (same as the positional BAG; the launch file uses it)")
    ap.add_argument("--rate", type=float, default=1.0, help="time multiplier")
    ap.add_argument("--camera-hz", type=float, default=0.0, help="republish the newest frame at this rate "
                                                                 "with fresh stamps (0 = original timing)")
    ap.add_argument("--loop", action="store_true", help="start over at the end of the bag")
    ap.add_argument("--start-offset", type=float, default=0.0, help="seconds into the bag to start from")
    ap.add_argument("--decode", action="store_true", help="publish compressed frames as decoded rgb8 Images")
    ap.add_argument("--no-restamp", dest="restamp", action="store_false", help="keep the bag's header stamps")
    ap.add_argument("--duration-s", type=float, default=0.0, help="stop after this long (0 = at the end)")
    ap.add_argument("--wait-for", action="append", default=[], metavar="TOPIC",
                    help="before playing, wait until this topic has a subscriber (repeatable)")
    ap.add_argument("--wait-timeout-s", type=float, default=10.0, help="give up waiting after this long")
    ap.add_argument("--stats-out", default=None, help="write the replay's counts as JSON here at exit")
    return ap


def main(args=None) -> int:
    argv = list(sys.argv if args is None else args)
    opts = build_parser().parse_args(remove_ros_args(argv)[1:])
    rclpy.init(args=argv, signal_handler_options=SignalHandlerOptions.NO)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        node = BagReplay({"bag": opts.bag or opts.bag_path, "rate": opts.rate, "camera_hz": opts.camera_hz,
                          "loop": opts.loop, "start_offset": opts.start_offset, "decode": opts.decode, "restamp": opts.restamp,
                          "duration_s": opts.duration_s, "wait_for": opts.wait_for or [""],
                          "wait_timeout_s": opts.wait_timeout_s})
        unknown = [t for t in node.wait_for if t not in node._pubs]
        if unknown:
            raise ValueError(f"--wait-for names topics the replay does not publish: {', '.join(unknown)}")
    except Exception as exc:  # bad arguments / unreadable bag: say so and exit non-zero
        print(f"vla_bag_replay: error: {exc}", file=sys.stderr)
        rclpy.try_shutdown()
        return EXIT_UNREADABLE
    ex = SingleThreadedExecutor()
    ex.add_node(node)
    spin = threading.Thread(target=ex.spin, name="bag_replay_spin", daemon=True)
    spin.start()
    player = threading.Thread(target=node.run, name="bag_replay_player", daemon=True)
    player.start()
    while not stop.is_set() and not node.done.is_set():
        stop.wait(0.1)
    if not stop.is_set():  # reached the end: let reliable subscribers acknowledge the last messages
        stop.wait(LINGER_S)
    node.stop()
    player.join(timeout=5.0)
    summary = node.summary()
    node.get_logger().info("replay finished: " + json.dumps(summary))
    if opts.stats_out:
        Path(opts.stats_out).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.stats_out).write_text(json.dumps(summary, indent=2))
    code = EXIT_OK
    if node.partial:
        lost = [node.bag_note] if node.bag_note else []
        lost += [f"{n} message(s) on {t} skipped ({node.skip_reasons[t]})" for t, n in node.skipped_messages.items()]
        lost += [node.read_error] if node.read_error else []
        published = sum(n for k, n in summary["published"].items())
        print(f"vla_bag_replay: {'partial replay' if published else 'nothing replayed'} of {node.bag}: "
              + "; ".join(lost), file=sys.stderr)
        code = EXIT_PARTIAL if published else EXIT_UNREADABLE
    _teardown_or_exit(node, ex, spin, code)
    return code


def _teardown_or_exit(node: BagReplay, ex: SingleThreadedExecutor, spin: threading.Thread, code: int) -> None:
    """rclpy teardown, bounded: once seen in CI (2 cores under load), a replay that had logged and written its
    summary hung in it until its parent killed it 11 s later, a failed exit for a complete replay. Everything the
    replay owes is out by now, so a teardown past TEARDOWN_S ends the process with the status it already has."""
    sys.stdout.flush()
    sys.stderr.flush()
    watchdog = threading.Timer(TEARDOWN_S, lambda: os._exit(code))
    watchdog.daemon = True
    watchdog.start()
    ex.shutdown(timeout_sec=2.0)
    spin.join(timeout=2.0)
    node.destroy_node()
    rclpy.try_shutdown()
    watchdog.cancel()


if __name__ == "__main__":
    sys.exit(main())
