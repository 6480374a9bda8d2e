"""The lifecycle of vla_inference driven through its lifecycle services from another process:
configure / activate / deactivate / cleanup, an invalid transition answered (not crashing the node), and a
failing configure leaving the node in a defined state with the reason on /diagnostics, then configured with a
valid checkpoint once one is installed."""
from __future__ import annotations

import shutil
import threading
import time

import pytest

from ros_env import call_answered, read_json, wait_for

rclpy = pytest.importorskip("rclpy")


class LifecycleClient:
    """Lifecycle service clients and a /diagnostics listener in this process, on the domain of ``procs``."""

    def __init__(self, procs):
        from diagnostic_msgs.msg import DiagnosticArray
        from lifecycle_msgs.srv import ChangeState, GetState
        from rclpy.executors import SingleThreadedExecutor

        from vla_edge_ros.ros import qos

        procs.apply_env()
        self.ctx = rclpy.context.Context()
        rclpy.init(context=self.ctx, args=[])
        self.node = rclpy.create_node("lifecycle_test_client", context=self.ctx)
        self.change = self.node.create_client(ChangeState, "/vla_inference/change_state")
        self.get = self.node.create_client(GetState, "/vla_inference/get_state")
        self.diag: dict = {}
        self.node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diag, qos.reliable_qos())
        self.ex = SingleThreadedExecutor(context=self.ctx)
        self.ex.add_node(self.node)
        self.th = threading.Thread(target=self.ex.spin, daemon=True)
        self.th.start()

    def _on_diag(self, msg):
        for st in msg.status:
            if st.name == "vla_inference: engine":
                self.diag = {kv.key: kv.value for kv in st.values} | {"_level": st.level, "_message": st.message}

    def _call(self, client, req, timeout_s=60.0):
        fut = client.call_async(req)
        assert wait_for(fut.done, timeout_s), "no answer"
        return fut.result()

    def ready(self):
        """Both services answer (see call_answered for why wait_for_service is not enough): each is pinged with
        a request that is safe to repeat, GetState and ChangeState 'activate', which is refused while the node
        is unconfigured (both tests call this while it is)."""
        from lifecycle_msgs.msg import Transition
        from lifecycle_msgs.srv import ChangeState, GetState

        assert self.get.wait_for_service(timeout_sec=30.0) and self.change.wait_for_service(timeout_sec=30.0)
        call_answered(lambda: self.get.call_async(GetState.Request()), what="get_state")
        req = ChangeState.Request()
        req.transition.id = Transition.TRANSITION_ACTIVATE
        assert call_answered(lambda: self.change.call_async(req), what="change_state").success is False

    def state(self) -> str:
        from lifecycle_msgs.srv import GetState

        return self._call(self.get, GetState.Request()).current_state.label

    def transition(self, tid: int = 0, label: str = "") -> bool:
        from lifecycle_msgs.srv import ChangeState

        req = ChangeState.Request()
        req.transition.id, req.transition.label = tid, label
        return self._call(self.change, req).success

    def close(self):
        self.ex.shutdown(timeout_sec=2.0)
        self.node.destroy_node()
        rclpy.shutdown(context=self.ctx)


def _start(procs, *ros_params, autostart=False, camera=True):
    stats = procs.tmp / "runtime.json"
    runtime = procs.runtime("-p", "kv_budget_tokens:=512", *ros_params, stats_out=stats, stats_every_s=0.3,
                            cli=[] if autostart else ["--no-autostart"])
    cam = procs.camera("-p", "width:=160", "-p", "height:=120", "-p", "rate_hz:=30.0") if camera else None
    return runtime, cam, stats


def _stats(stats):
    try:
        return read_json(stats)
    except (OSError, ValueError):
        return None


def test_configure_activate_deactivate_cleanup_and_invalid_transition(ros_processes):
    from lifecycle_msgs.msg import Transition as T

    runtime, cam, stats = _start(ros_processes)
    lc = LifecycleClient(ros_processes)
    try:
        lc.ready()
        assert lc.state() == "unconfigured"
        # invalid requests while unconfigured: answered success=False, the process lives on
        assert lc.transition(T.TRANSITION_ACTIVATE) is False
        assert lc.transition(label="activate") is False
        assert lc.transition(T.TRANSITION_DEACTIVATE) is False
        time.sleep(0.3)
        assert runtime.alive(), runtime.output()
        assert lc.state() == "unconfigured"
        assert "invalid transition" in runtime.output()

        assert lc.transition(T.TRANSITION_CONFIGURE) is True
        assert lc.state() == "inactive"
        s = _stats(stats)
        assert wait_for(lambda: (s := _stats(stats)) and s["inference"]["state"] == "inactive", 5.0)
        time.sleep(1.0)
        s = _stats(stats)
        assert s["chunks"]["admitted"] == 0  # configured (warm-up only), not admitting
        assert s["action"]["arbiter"]["stale_reasons"] == ["inference_inactive"]
        assert s["inference"]["loop"]["warmup"]["chunks"] == 3
        assert s["inference"]["engine_memory"]["current_bytes"] > 0
        rss_configured = s["inference"]["rss_mb"]

        assert lc.transition(T.TRANSITION_ACTIVATE) is True
        assert lc.state() == "active"
        assert wait_for(lambda: (s := _stats(stats)) and s["ticks"]["fresh"] > 10, 20.0), _stats(stats)

        assert lc.transition(T.TRANSITION_DEACTIVATE) is True
        assert lc.state() == "inactive"
        time.sleep(0.8)  # let a chunk in flight finish and the stats file catch up
        s1 = _stats(stats)
        time.sleep(1.5)
        s2 = _stats(stats)
        assert s2["chunks"]["admitted"] == s1["chunks"]["admitted"]  # inference paused
        assert s2["ticks"]["hold"] - s1["ticks"]["hold"] >= 30  # the publisher holds (~45 ticks in 1.5 s)
        assert s2["ticks"]["fresh"] == s1["ticks"]["fresh"]
        assert lc.transition(T.TRANSITION_CONFIGURE) is False  # invalid from inactive
        assert runtime.alive()

        assert lc.transition(T.TRANSITION_ACTIVATE) is True  # resume
        n = _stats(stats)["ticks"]["fresh"]
        assert wait_for(lambda: _stats(stats)["ticks"]["fresh"] > n + 10, 20.0)
        assert lc.transition(T.TRANSITION_DEACTIVATE) is True

        assert lc.transition(T.TRANSITION_CLEANUP) is True
        assert lc.state() == "unconfigured"
        assert wait_for(lambda: _stats(stats)["inference"]["state"] == "unconfigured", 5.0)
        s = _stats(stats)
        assert s["inference"]["kv_manager"] == {} and s["inference"]["loop"] == {}  # engine and loop released
        assert s["inference"]["engine_memory"]["current_bytes"] == 0
        print(f"lifecycle: RSS {rss_configured:.1f} MiB configured -> {s['inference']['rss_mb']:.1f} MiB after "
              f"cleanup")
        assert lc.transition(T.TRANSITION_CONFIGURE) is True  # can be configured again
        assert lc.state() == "inactive"
    finally:
        lc.close()
    codes = ros_processes.stop(runtime, cam)
    assert codes == {"runtime": 0, "camera": 0}, runtime.output()[-3000:]


def test_failed_configure_reports_reason_and_stays_unconfigured(tmp_path, ros_processes):
    from lifecycle_msgs.msg import Transition as T

    runtime, cam, stats = _start(ros_processes, "-p", f"checkpoint:={tmp_path / 'no_such_checkpoint'}",
                                 autostart=True, camera=False)
    lc = LifecycleClient(ros_processes)
    try:
        assert wait_for(lambda: "configure failed" in runtime.output(), 30.0), runtime.output()
        lc.ready()
        assert lc.state() == "unconfigured"
        assert wait_for(lambda: lc.diag.get("last_error", ""), 5.0)
        assert "configure failed" in lc.diag["last_error"] and "no_such_checkpoint" in lc.diag["last_error"]
        assert lc.diag["_level"] == b"\x02" or lc.diag["_level"] == 2  # ERROR
        assert lc.transition(T.TRANSITION_CONFIGURE) is False  # still failing, still answered
        assert lc.state() == "unconfigured"
        assert runtime.alive()
        s = _stats(stats)
        assert s["ticks"]["fresh"] == 0 and s["ticks"]["hold"] > 0  # the publisher holds throughout
        # the operator installs the checkpoint where the parameter points: configure again works, the error
        # clears from /diagnostics, and the node runs
        from vla_edge_ros.engine.factory import resolve_checkpoint

        shutil.copytree(resolve_checkpoint(""), tmp_path / "no_such_checkpoint")
        assert lc.transition(T.TRANSITION_CONFIGURE) is True
        assert lc.state() == "inactive"
        assert wait_for(lambda: lc.diag.get("last_error", "x") == "" and lc.diag.get("state") == "inactive", 5.0), \
            lc.diag
        assert lc.diag["_level"] in (b"\x01", 1)  # WARN: inactive
        assert lc.transition(T.TRANSITION_ACTIVATE) is True
        assert wait_for(lambda: lc.diag.get("state") == "active" and lc.diag["_level"] in (b"\x00", 0), 5.0), \
            lc.diag
    finally:
        lc.close()
    assert ros_processes.stop(runtime) == {"runtime": 0}, runtime.output()[-3000:]
