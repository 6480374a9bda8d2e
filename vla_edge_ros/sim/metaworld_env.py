"""MetaWorld (MuJoCo) as the simulated arm: seeded initial states that really vary, one fixed camera.

Why not ``gym.make('Meta-World/MT1', ...)``: MT1 draws 50 initial states once per benchmark seed and
``reset(seed=...)`` alone does not change the scene (drawer-close came out identical for seeds 0 and 1).
Here the environment class is built directly and its reset range is sampled from the env's own seeded RNG
(``_freeze_rand_vec = False``, ``seeded_rand_vec = True``, ``env.seed(seed)`` before each reset), so every seed
gives its own object / goal placement from ``_random_reset_space`` and the same seed gives the same scene again
(an episode is replayed from its seed). The goal stays in the state observation (``_partially_observable =
False``) because the scripted experts read it; the image policy sees the goal only as the env's goal marker.

Rendering: ``mujoco.Renderer`` directly (offscreen, ``MUJOCO_GL=egl`` by default, set in sim/__init__.py),
shadows and reflections off (measured on the 2-core CPU machine with Mesa EGL: 96x96 ~37 ms without, ~200 ms
with them; 64 and 128 px cost about the same, the per-frame overhead dominates). MetaWorld's corner
cameras look at the table upside down (their image-up axis points below the horizon); such images are rotated
by 180 degrees so that up is up. The GL context is created on the first ``render()`` and made current in the
calling thread: render from one thread (the sim node renders and steps in its one executor thread) and
``close()`` from it.
"""
from __future__ import annotations

import os
from typing import Optional

import mujoco  # MUJOCO_GL defaults to egl: vla_edge_ros/sim/__init__.py
import numpy as np
from metaworld.env_dict import ALL_V3_ENVIRONMENTS

from vla_edge_ros.sim.action_map import ENV_ACTION_DIMS, ActionMapping
from vla_edge_ros.sim.tasks import CAMERAS, DEFAULT_CAMERA, task_spec

DEFAULT_HORIZON = 200  # control steps; see probe.py for the experts' step counts


class MetaWorldSim:
    def __init__(self, task: str, camera: str = DEFAULT_CAMERA, width: int = 96, height: int = 96,
                 horizon: int = DEFAULT_HORIZON, shadows: bool = False):
        self.spec = task_spec(task)
        if camera not in CAMERAS:
            raise ValueError(f"unknown camera {camera!r}; one of: {', '.join(CAMERAS)}")
        if not (width > 0 and height > 0):
            raise ValueError(f"image size must be positive, got {width}x{height}")
        if horizon < 1:
            raise ValueError(f"horizon must be >= 1 step, got {horizon}")
        env = ALL_V3_ENVIRONMENTS[self.spec.env_name]()
        env._partially_observable = False  # goal position in the state observation (the experts need it)
        try:
            del env.sawyer_observation_space  # a cached property computed for the partially observable case
        except AttributeError:
            pass
        env._set_task_called = True  # we set the task's randomisation ourselves, no benchmark Task object
        env._freeze_rand_vec = False
        env.seeded_rand_vec = True  # draw the reset range from env.np_random (seeded per episode)
        env.max_path_length = int(horizon)  # the env refuses to step past it; episodes end at horizon anyway
        self.env = env
        self.task, self.instruction = self.spec.key, self.spec.instruction
        self.camera, self.width, self.height, self.shadows = camera, int(width), int(height), bool(shadows)
        self.horizon = int(horizon)
        self.mapping = ActionMapping(float(env.action_scale))
        self._renderer: Optional[mujoco.Renderer] = None
        mujoco.mj_forward(env.model, env.data)
        cam = env.model.camera(camera).id
        self.rotate_180 = bool(env.data.cam_xmat[cam].reshape(3, 3)[2, 1] < 0.0)  # image-up points downwards
        self.seed: Optional[int] = None
        self.obs: Optional[np.ndarray] = None
        self.steps = 0
        self.last_info: dict = {}

    # ---- episode -------------------------------------------------------------------------------------
    def reset(self, seed: int) -> np.ndarray:
        """Reset to the initial state of ``seed`` (object / goal placement drawn from the env's reset range)."""
        self.env.seed(int(seed))
        obs, _ = self.env.reset()
        self.seed, self.obs, self.steps, self.last_info = int(seed), obs, 0, {}
        return obs

    def step_env(self, env_action) -> bool:
        """One env step with a 4-dim MetaWorld action; returns the env's success flag."""
        if self.seed is None:
            raise RuntimeError("reset(seed) before stepping")
        a = np.asarray(env_action, dtype=np.float64).reshape(-1)
        if a.shape[0] != ENV_ACTION_DIMS or not np.all(np.isfinite(a)):
            raise ValueError(f"env action must be {ENV_ACTION_DIMS} finite numbers, got {a.tolist()}")
        obs, _reward, _term, _trunc, info = self.env.step(a)
        self.obs, self.last_info = obs, info
        self.steps += 1
        return bool(info.get("success", 0.0))

    def ee_position(self) -> np.ndarray:
        """Tool centre point (between the finger pads), metres."""
        return np.array(self.env.tcp_center, dtype=np.float64)

    def scene_state(self) -> np.ndarray:
        """Everything a seed decides: joint positions of the whole scene and the goal position."""
        return np.concatenate([self.env.data.qpos.ravel(), np.asarray(self.env._target_pos, np.float64).ravel()])

    # ---- camera --------------------------------------------------------------------------------------
    def render(self) -> np.ndarray:
        """(height, width, 3) uint8 RGB of the fixed camera."""
        if self._renderer is None:
            vis = self.env.model.vis.global_
            vis.offwidth, vis.offheight = max(vis.offwidth, self.width), max(vis.offheight, self.height)
            try:
                self._renderer = mujoco.Renderer(self.env.model, self.height, self.width)
            except mujoco.FatalError as exc:
                raise RuntimeError(f"no offscreen GL context ({exc}); MUJOCO_GL={os.environ.get('MUJOCO_GL')!r}: set "
                                   "MUJOCO_GL=egl (or osmesa) before mujoco is imported, e.g. import "
                                   "vla_edge_ros.sim before mujoco / metaworld") from exc
        r = self._renderer
        r.update_scene(self.env.data, camera=self.camera)
        if not self.shadows:
            r.scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = 0
            r.scene.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0
        img = r.render()
        return np.ascontiguousarray(img[::-1, ::-1]) if self.rotate_180 else img

    def close(self) -> None:
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None
        self.env.close()
