"""The simulated tasks: which MetaWorld environment, what the instruction says, which expert solves it.

MetaWorld ships no language; the instruction of each task is written here so that the runtime's
``instruction`` parameter selects the task the way a VLA is conditioned (the language goes into the pinned
prefix). The goal colour is named where the goal is only a marker: in reach / push / pick-place the target
position is drawn only as a coloured sphere (the env's ``goal`` site: red, green, blue), and it is the ONLY
visual cue of where to go, so the marker stays visible (hiding it would make these tasks unsolvable from
pixels). In drawer-close and button-press-topdown the goal is implied by the scene (a drawer, a button).

Pure: no metaworld import (tests and the parameter table read it without the ``sim`` extra).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TaskSpec:
    key: str  # the name used in parameters and results ('push')
    env_name: str  # MetaWorld v3 environment ('push-v3'); also the key of metaworld.policies.ENV_POLICY_MAP
    instruction: str
    goal_marker: bool  # the goal is shown only by the env's 'goal' site (kept visible)


TASKS: dict[str, TaskSpec] = {t.key: t for t in (
    TaskSpec("reach", "reach-v3", "reach the red goal", True),
    TaskSpec("push", "push-v3", "push the puck to the green goal", True),
    TaskSpec("pick-place", "pick-place-v3", "pick up the puck and place it at the blue goal", True),
    TaskSpec("drawer-close", "drawer-close-v3", "close the drawer", False),
    TaskSpec("button-press-topdown", "button-press-topdown-v3", "press the button from the top", False),
)}
TASK_KEYS = tuple(TASKS)

# The fixed cameras of MetaWorld's Sawyer scene (the same in every task). 'corner' is the default: in
# segmentation renders along expert episodes (``python -m vla_edge_ros.sim.probe``, 96 px) it shows the gripper,
# the task object and the goal marker together in 95-100 % of the frames of all five tasks (the rest: the hand
# over the puck or the button), like 'corner4'; 'topview' hides the gripper under the arm (0-27 %),
# 'behindGripper' 82-100 %, 'gripperPOV' 11-100 %. At 96 px the puck covers ~8 px and the goal marker ~5 px.
CAMERAS = ("corner", "corner2", "corner3", "corner4", "topview", "behindGripper", "gripperPOV")
DEFAULT_CAMERA = "corner"


def task_spec(key: str) -> TaskSpec:
    try:
        return TASKS[key]
    except KeyError:
        raise ValueError(f"unknown sim task {key!r}; one of: {', '.join(TASK_KEYS)}") from None


def task_for_instruction(instruction: str) -> TaskSpec:
    """The task whose instruction this is (exact text after whitespace/case folding); ValueError otherwise."""
    folded = " ".join(instruction.lower().split())
    for t in TASKS.values():
        if t.instruction == folded:
            return t
    raise ValueError(f"no sim task has the instruction {instruction!r}")
