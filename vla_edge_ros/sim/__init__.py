"""vla_edge_ros.sim: a simulated arm for the closed loop (issue 21), without rclpy.

Why a package of its own: the simulator is what turns the runtime's actions into task success, so its pieces
must be testable and reusable without ROS -- by the sim node (ros/sim_node.py), by demonstration recording and
by the evaluation:

- tasks.py       the task table: MetaWorld environment, instruction text, scripted expert per task (pure);
- action_map.py  the explicit 7-dim runtime action <-> 4-dim MetaWorld action mapping and the action gate that
                 rejects malformed actions with a counted reason (pure numpy);
- episode.py     the episode result (to_json) and the controller that applies the newest command once per
                 control step, holds when it must, ends episodes at success or horizon and moves to the next
                 seed (pure: it drives any object with the small env interface below);
- metaworld_env.py  the MetaWorld wrapper (seeded initial states that really vary, a fixed camera rendered with
                 mujoco.Renderer, shadows and reflections off);
- expert.py      the benchmark's scripted experts in the runtime's 7-dim naming, and a synchronous expert episode;
- params.py      the vla_sim node's parameter table (ParamSpec lines, for the registry);
- probe.py       ``python -m vla_edge_ros.sim.probe``: step / render timing and expert success on this machine.

Only metaworld_env.py, expert.py and probe.py import metaworld / mujoco (the optional ``sim`` extra).
"""
import os

# Headless offscreen rendering unless the user chose a GL backend: mujoco picks its GL platform when it is first
# imported (by metaworld as well), so this must run before any submodule imports them -- and a program that imports
# mujoco or metaworld itself must import vla_edge_ros.sim first.
os.environ.setdefault("MUJOCO_GL", "egl")
del os
