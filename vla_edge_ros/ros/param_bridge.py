"""Declare a node's ROS parameters from the registry (vla_edge_ros/params.py) and validate every change.

- Each ParamSpec becomes an rclpy ParameterDescriptor: description (+ when a live change applies),
  FloatingPointRange / IntegerRange from min/max, the choices appended to the description (ROS has no enum
  descriptor), ``read_only`` for parameters that cannot change while the node runs.
- Values given at start-up (``--ros-args --params-file``) are validated as a whole (types, ranges, choices,
  cross-parameter rules); a bad file stops the node with every reason listed.
- One ``add_on_set_parameters_callback`` validates live changes with params.validate /
  params.validate_combination and answers ``SetParametersResult(successful=False, reason=...)`` on
  rejection -- exactly what ``ros2 param set`` prints. Accepted changes are handed to ``on_change`` (the node
  applies them at the point the registry documents) after rclpy stored them.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from rcl_interfaces.msg import (
    FloatingPointRange,
    IntegerRange,
    ParameterDescriptor,
    ParameterType,
    SetParametersResult,
)
from rclpy.node import Node
from rclpy.parameter import Parameter

from vla_edge_ros import params as registry

_ROS_TYPES = {
    bool: ParameterType.PARAMETER_BOOL,
    int: ParameterType.PARAMETER_INTEGER,
    float: ParameterType.PARAMETER_DOUBLE,
    str: ParameterType.PARAMETER_STRING,
}
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


class ParameterRejected(ValueError):
    """Start-up parameters (from a params file / overrides) that fail validation; lists every reason."""

    def __init__(self, node_name: str, reasons: list[str]):
        self.reasons = list(reasons)
        super().__init__(f"{node_name}: invalid parameters: " + "; ".join(reasons))


def descriptor_for(spec: registry.ParamSpec) -> ParameterDescriptor:
    desc = spec.description
    if spec.choices:
        desc += f" (one of: {', '.join(spec.choices)})"
    if spec.live:
        desc += f" [live; applies {spec.applies or 'at once'}]"
    else:
        desc += " [read-only while running]"
    d = ParameterDescriptor(
        name=spec.name,
        type=_ROS_TYPES[spec.type],
        description=desc,
        read_only=not spec.live,
    )
    if spec.choices:
        d.additional_constraints = "one of: " + ", ".join(spec.choices)
    if spec.type is float and (spec.min is not None or spec.max is not None):
        d.floating_point_range = [FloatingPointRange(
            from_value=float(spec.min) if spec.min is not None else -float("inf"),
            to_value=float(spec.max) if spec.max is not None else float("inf"),
            step=0.0)]
    elif spec.type is int and (spec.min is not None or spec.max is not None):
        d.integer_range = [IntegerRange(
            from_value=int(spec.min) if spec.min is not None else _INT64_MIN,
            to_value=int(spec.max) if spec.max is not None else _INT64_MAX,
            step=0)]
    return d


class ParamBridge:
    """Owns the declared parameters of one node.

    ``values`` always holds the accepted, current value of every registry parameter of the node.
    ``on_change(changes: dict)`` is called with the accepted live changes (after validation) from the
    executor thread of the node; it must not block.
    """

    def __init__(self, node: Node, node_key: str,
                 on_change: Callable[[dict[str, Any]], None] | None = None,
                 prefix_tokens: Callable[[], int] | None = None):
        self.node = node
        self.node_key = node_key
        self.specs = {s.name: s for s in registry.for_node(node_key)}
        self._on_change = on_change
        self._prefix_tokens = prefix_tokens or (lambda: 0)
        self.rejections: list[str] = []  # last reasons, for diagnostics
        self.values: dict[str, Any] = {}
        for spec in self.specs.values():
            p = node.declare_parameter(spec.name, spec.default, descriptor_for(spec))
            self.values[spec.name] = p.value
        reasons = registry.validate_all(self.values)
        if reasons:
            raise ParameterRejected(node.get_name(), reasons)
        node.add_on_set_parameters_callback(self._validate_and_apply)

    def get(self, name: str) -> Any:
        return self.values[name]

    def _validate_and_apply(self, parameters: list[Parameter]) -> SetParametersResult:
        changes: dict[str, Any] = {}
        reasons: list[str] = []
        for p in parameters:
            spec = self.specs.get(p.name)
            if spec is None:
                # Parameters outside the registry (use_sim_time, qos overrides) are rclpy's business.
                continue
            if not spec.live:
                reasons.append(f"{p.name} is read-only while the node runs (restart or reconfigure to change)")
                continue
            why = registry.validate(p.name, p.value)
            if why:
                reasons.append(why)
            else:
                changes[p.name] = float(p.value) if spec.type is float else p.value
        if not reasons and changes:
            reasons = registry.validate_combination({**self.values, **changes}, self._prefix_tokens())
        if reasons:
            self.rejections = reasons
            msg = "; ".join(reasons)
            self.node.get_logger().warning(f"parameter change rejected: {msg}")
            return SetParametersResult(successful=False, reason=msg)
        if changes:
            previous = {k: self.values[k] for k in changes}
            self.values.update(changes)
            if self._on_change is not None:
                try:
                    self._on_change(dict(changes))
                except Exception as exc:  # applying failed: refuse, and keep our view equal to rclpy's
                    self.values.update(previous)
                    self.node.get_logger().error(f"applying {changes} failed: {exc!r}")
                    return SetParametersResult(successful=False, reason=f"applying failed: {exc}")
        return SetParametersResult(successful=True)


def initial_overrides(values: Mapping[str, Any]) -> list[Parameter]:
    """rclpy Parameter list for ``Node(parameter_overrides=...)`` (used by runtime/demo to pass values)."""
    return [Parameter(k, value=v) for k, v in values.items()]
