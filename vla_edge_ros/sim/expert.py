"""The benchmark's own scripted experts, speaking the runtime's 7-dim action.

metaworld.policies has one hand-written policy per task (state in, 4-dim env action out). Demonstrations and
the expert baseline must command the arm exactly as a policy does through the runtime, so the expert's action
is turned into the 7-dim naming (action_map.ActionMapping.from_env) and applied through the same gate and
controller (episode.SimController) as a received action: fresh action in, 7 -> 4 mapping, env step.
"""
from __future__ import annotations

import time
import warnings
from typing import Callable, Optional

import numpy as np
from metaworld.policies import ENV_POLICY_MAP

from vla_edge_ros.sim.episode import EpisodeResult, SimController
from vla_edge_ros.sim.metaworld_env import MetaWorldSim


class ScriptedExpert:
    def __init__(self, sim: MetaWorldSim):
        self.sim = sim
        self.policy = ENV_POLICY_MAP[sim.spec.env_name]()

    def env_action(self, obs: Optional[np.ndarray] = None) -> np.ndarray:
        """The expert's 4-dim env action for ``obs`` (default: the sim's current observation)."""
        with warnings.catch_warnings():
            # metaworld.policies.move() warns whenever its gain drives the response past [-1, 1]; clipping is
            # documented behaviour (the env clips, and ActionMapping.from_env clips first): only noise.
            warnings.filterwarnings("ignore", message=r"Constant\(s\) may be too high", category=UserWarning)
            return np.asarray(self.policy.get_action(self.sim.obs if obs is None else obs), dtype=np.float64)

    def action7(self, obs: Optional[np.ndarray] = None) -> np.ndarray:
        """The same action in the runtime's naming (x y z roll pitch yaw gripper)."""
        return self.sim.mapping.from_env(self.env_action(obs))


def run_expert_episode(sim: MetaWorldSim, seed: int,
                       on_step: Optional[Callable[[MetaWorldSim, np.ndarray], None]] = None) -> EpisodeResult:
    """One synchronous expert episode from ``seed``: every step the expert's 7-dim action is offered as a fresh
    action and applied by a SimController (one episode). ``on_step(sim, action7)`` sees the state before each
    step (e.g. to render and record a demonstration)."""
    expert = ScriptedExpert(sim)
    ctl = SimController(sim, seed_start=seed, num_episodes=1, action_timeout_ms=1e9, clock_ns=time.monotonic_ns)
    while True:
        a7 = expert.action7()
        if on_step is not None:
            on_step(sim, a7)
        ctl.offer("fresh", a7)
        result = ctl.control_step()
        if result is not None:
            return result
