"""How long a thread waits to get the GIL back while ROS executors take camera messages in the same process.

Why: in the 8-robot fleet replay on the H200 the edge's inference thread waited 50-80 ms in a slow pass for 3 ms
of CPU on a machine 11 % busy; py-spy --gil named the holders, first the eight camera executors (rclpy's Python
``SingleThreadedExecutor``: taking a message, building the wait set) (docs/FIGURES.md, session 21). Every numpy or
CUDA call of the inference thread releases the GIL and must win it back. This measures that price on any machine,
without a GPU: ``--topics`` subscriptions at ``--hz`` of ``--size`` rgb8 images (published by a child process),
each spun by its own executor thread (the runtime's layout), for each executor kind asked: rclpy's Python
``single``, rclpy's C++ ``events`` (``rclpy.experimental.EventsExecutor``), and ``none`` (no messages: the
baseline). A probe thread sleeps 1 ms at a time (a GIL release, as the inference thread's calls are) and records
by how much each wake-up overshoots; the table gives its p50 / p99 / max side by side, the messages taken and the
process's CPU per second.

    python -m vla_edge_ros.bench.gil_probe --topics 8 --hz 60 --size 64x64 --seconds 20 --executors none,single,events
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

EXECUTORS = ("none", "single", "events")


def parse_size(text: str) -> tuple[int, int]:
    try:
        h, w = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--size must be HxW, e.g. 64x64, got {text!r}") from None
    if h < 1 or w < 1:
        raise ValueError(f"--size must be positive, got {text!r}")
    return h, w


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--topics", type=int, default=8, help="subscriptions, one executor thread each")
    ap.add_argument("--hz", type=float, default=60.0, help="messages per second per topic")
    ap.add_argument("--size", default="64x64", help="image HxW (rgb8)")
    ap.add_argument("--seconds", type=float, default=20.0, help="probe time per executor kind")
    ap.add_argument("--executors", default="none,single,events", help=f"comma-separated, of {', '.join(EXECUTORS)}")
    ap.add_argument("--probe-ms", type=float, default=1.0, help="the probe's sleep")
    ap.add_argument("--domain-id", type=int, default=61)
    ap.add_argument("--publish", action="store_true", help=argparse.SUPPRESS)  # the child: publish until killed
    args = ap.parse_args(argv)
    args.size_hw = parse_size(args.size)
    args.kinds = [k.strip() for k in args.executors.split(",") if k.strip()]
    bad = [k for k in args.kinds if k not in EXECUTORS]
    if bad or not args.kinds:
        ap.error(f"--executors: {', '.join(bad) or 'none given'}; choose from {', '.join(EXECUTORS)}")
    if args.topics < 1 or not args.hz > 0 or not args.seconds > 0 or not args.probe_ms > 0:
        ap.error("--topics, --hz, --seconds and --probe-ms must be positive")
    return args


def topic(k: int) -> str:
    return f"/gil_probe/cam{k}/image_raw"


# ---- the publisher (child process) ------------------------------------------------------------------------------

def publish(args: argparse.Namespace) -> int:
    """Publish ``--topics`` image topics at ``--hz`` until SIGINT / SIGTERM (one timer, every topic per tick)."""
    import rclpy
    from rclpy.executors import SingleThreadedExecutor
    from sensor_msgs.msg import Image

    from vla_edge_ros.ros.qos import camera_subscription_qos_no_deadline
    rclpy.init()
    node = rclpy.create_node("gil_probe_publisher")
    qos = camera_subscription_qos_no_deadline()  # sensor data: keep last 1, best effort
    pubs = [node.create_publisher(Image, topic(k), qos) for k in range(args.topics)]
    h, w = args.size_hw
    msg = Image(height=h, width=w, encoding="rgb8", step=3 * w, data=bytes(h * w * 3))

    parent = os.getppid()

    def tick():
        if os.getppid() != parent:  # the probe died without stopping us (killed): stop publishing
            rclpy.try_shutdown()
            return
        msg.header.stamp = node.get_clock().now().to_msg()
        for p in pubs:
            p.publish(msg)

    node.create_timer(1.0 / args.hz, tick)
    ex = SingleThreadedExecutor()
    ex.add_node(node)
    try:
        ex.spin()
    except (KeyboardInterrupt, Exception):
        pass
    finally:
        rclpy.try_shutdown()
    return 0


# ---- the measurement ------------------------------------------------------------------------------------------

def probe(seconds: float, sleep_ms: float) -> np.ndarray:
    """Overshoots (ms) of ``time.sleep(sleep_ms)`` over ``seconds``: the wake-up and the wait for the GIL."""
    out, t_end, s = [], time.perf_counter() + seconds, sleep_ms / 1e3
    while True:
        t0 = time.perf_counter()
        if t0 >= t_end:
            break
        time.sleep(s)
        out.append((time.perf_counter() - t0 - s) * 1e3)
    return np.asarray(out, np.float64)


def run_kind(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """Subscribe (unless ``none``), spin one executor per subscription in its own thread, probe, tear down."""
    import rclpy
    from rclpy.context import Context
    from sensor_msgs.msg import Image

    from vla_edge_ros.ros.qos import camera_subscription_qos_no_deadline
    ctx = Context()
    rclpy.init(context=ctx)
    taken = [0] * args.topics
    nodes, executors, threads = [], [], []
    stop = threading.Event()

    def on_image(k: int, msg: Any) -> None:  # what a camera callback does at least: the pixels as an array
        np.frombuffer(msg.data, np.uint8)
        taken[k] += 1

    try:
        for k in range(args.topics if kind != "none" else 0):
            node = rclpy.create_node(f"gil_probe_sub{k}", context=ctx)
            node.create_subscription(Image, topic(k), lambda m, k=k: on_image(k, m),
                                     camera_subscription_qos_no_deadline())
            if kind == "events":
                from rclpy.experimental import EventsExecutor
                ex = EventsExecutor(context=ctx)
            else:
                from rclpy.executors import SingleThreadedExecutor
                ex = SingleThreadedExecutor(context=ctx)
            ex.add_node(node)
            th = threading.Thread(target=_spin, args=(ex, stop), name=f"exec:{k}", daemon=True)
            nodes.append(node)
            executors.append(ex)
            threads.append(th)
            th.start()
        t_wait = time.monotonic() + 15.0  # discovery: every subscription has its first message, or 15 s
        while nodes and not all(taken) and time.monotonic() < t_wait:
            time.sleep(0.05)
        time.sleep(0.5)
        before = list(taken)
        cpu0, t0 = time.process_time(), time.perf_counter()
        over = probe(args.seconds, args.probe_ms)
        cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - t0
        got = sum(taken) - sum(before)
    finally:
        # the spins first, each by its own flag: rclpy 7.1's EventsExecutor deadlocked here when shut down
        # (ex.shutdown() under a running spin) or woken by the context's shutdown (its on_shutdown wake)
        stop.set()
        for th in threads:
            th.join(timeout=5.0)
        for ex in executors:
            ex.shutdown()
        for node in nodes:
            node.destroy_node()
        rclpy.try_shutdown(context=ctx)
    return {"kind": kind, "probes": int(len(over)), "messages_per_s": got / wall_s, "cpu_per_s": cpu_s / wall_s,
            "p50_ms": float(np.percentile(over, 50)), "p99_ms": float(np.percentile(over, 99)),
            "max_ms": float(over.max()), "over_5ms": int((over > 5.0).sum())}


def _spin(ex: Any, stop: threading.Event) -> None:
    try:
        while not stop.is_set():
            ex.spin_once(timeout_sec=0.05)
    except Exception:  # the context was shut down under it
        pass


def table(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [f"GIL probe: {args.topics} topics x {args.hz:g} Hz of {args.size} rgb8, a {args.probe_ms:g} ms sleep "
             f"probed for {args.seconds:g} s per executor kind; {os.cpu_count()} CPUs, Python "
             f"{sys.version.split()[0]}",
             "", "| executor | messages/s taken | probe overshoot p50 / p99 / max ms | overshoots > 5 ms | "
             "process CPU s/s |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['messages_per_s']:.0f} | {r['p50_ms']:.3f} / {r['p99_ms']:.3f} / "
                     f"{r['max_ms']:.1f} | {r['over_5ms']} of {r['probes']} | {r['cpu_per_s']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.publish:
        return publish(args)
    from vla_edge_ros.bench.procs import Child, ros_child_env
    with tempfile.TemporaryDirectory(prefix="vla_gil_probe_") as tmp:
        env = ros_child_env(args.domain_id, Path(tmp) / "ros_home")
        os.environ.update({k: env[k] for k in ("ROS_DOMAIN_ID", "ROS_HOME", "ROS_LOG_DIR", "RMW_IMPLEMENTATION",
                                               "FASTRTPS_DEFAULT_PROFILES_FILE", "ROS_AUTOMATIC_DISCOVERY_RANGE")})
        os.environ.pop("ROS_LOCALHOST_ONLY", None)
        pub: Optional[Child] = None
        rows = []
        try:
            for kind in args.kinds:
                if kind != "none" and pub is None:
                    pub = Child([sys.executable, "-m", "vla_edge_ros.bench.gil_probe", "--publish",
                                 "--topics", str(args.topics), "--hz", str(args.hz), "--size", args.size], env,
                                Path(tmp) / "publisher.log", name="publisher")
                    time.sleep(1.0)
                print(f"gil_probe: {kind} ...", flush=True)
                rows.append(run_kind(kind, args))
                r = rows[-1]
                print(f"gil_probe: {kind}: {r['messages_per_s']:.0f} messages/s, overshoot p99 {r['p99_ms']:.3f} ms",
                      flush=True)
        finally:
            if pub is not None:
                pub.stop(10.0)
    print(table(rows, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
