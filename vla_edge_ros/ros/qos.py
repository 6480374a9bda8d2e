"""QoS profiles of every topic the runtime uses, in one place.

Camera: sensor-data QoS (best effort, keep last 1, volatile) because a late frame is worth nothing to a
controller -- only the freshest one matters, and a reliable camera link would retransmit stale frames and
queue behind them. On top of it a QoS *deadline* and *automatic liveliness* so the middleware itself tells us
when the camera stalls (deadline missed) or its publisher dies (liveliness lost), without a polling timer.

Actions, action status and diagnostics: reliable, keep last, volatile. They are tiny; a consumer (a robot
driver, a logger) should get every one of them, and a late-joining subscriber needs no history.
"""
from __future__ import annotations

from rclpy.duration import Duration
from rclpy.qos import (
    DurabilityPolicy,
    HistoryPolicy,
    LivelinessPolicy,
    QoSProfile,
    ReliabilityPolicy,
)


def _duration_from_ms(ms: float) -> Duration:
    return Duration(nanoseconds=int(round(ms * 1e6)))


def _latest_frame_qos(deadline_ms: float | None = None, lease_ms: float | None = None) -> QoSProfile:
    """Keep last 1, best effort, volatile (sensor data); with a deadline and automatic liveliness when given."""
    extra = {}
    if deadline_ms is not None:
        extra = dict(deadline=_duration_from_ms(deadline_ms), liveliness=LivelinessPolicy.AUTOMATIC,
                     liveliness_lease_duration=_duration_from_ms(lease_ms))
    return QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1, reliability=ReliabilityPolicy.BEST_EFFORT,
                      durability=DurabilityPolicy.VOLATILE, **extra)


def camera_subscription_qos(deadline_ms: float, liveliness_lease_ms: float | None = None) -> QoSProfile:
    """Sensor-data QoS plus a deadline (the largest acceptable gap between frames) and automatic liveliness.

    The lease defaults to the deadline as well: a publisher process that dies stops asserting liveliness and
    the ``liveliness`` event fires about one lease later. Best-effort subscriptions match reliable and
    best-effort publishers; a publisher must offer a deadline at least as tight (or none: DDS treats a
    publisher without deadline as 'infinite', which is incompatible, so :func:`camera_publisher_qos` offers
    one and cameras from other vendors usually publish without a deadline -- see README, 'limits').
    """
    lease = liveliness_lease_ms if liveliness_lease_ms is not None else max(deadline_ms, 1000.0)
    return _latest_frame_qos(deadline_ms, lease)


def camera_subscription_qos_no_deadline() -> QoSProfile:
    """Plain sensor-data QoS (KEEP_LAST 1, best effort) without deadline/liveliness requirements."""
    return _latest_frame_qos()


def camera_publisher_qos(deadline_ms: float = 50.0, liveliness_lease_ms: float = 1000.0) -> QoSProfile:
    """What the built-in test camera and the bag replayer offer: best effort, keep last 1, with a deadline
    and liveliness lease at least as tight as the subscriber's request so the two match."""
    return _latest_frame_qos(deadline_ms, liveliness_lease_ms)


def reliable_qos(depth: int = 10) -> QoSProfile:
    """Actions, per-tick action status, fresh actions between edge and robot, diagnostics."""
    return QoSProfile(
        history=HistoryPolicy.KEEP_LAST,
        depth=depth,
        reliability=ReliabilityPolicy.RELIABLE,
        durability=DurabilityPolicy.VOLATILE,
    )
