"""The parameter registry (vla_edge_ros/params.py), config/runtime.yaml, the generated parameter tables (the
runtime nodes' in the README, vla_sim's in docs/SIM.md), the launch file and the parameters the nodes really
declare must agree."""
from __future__ import annotations

import ast
import math

import pytest
import yaml

from ros_env import rclpy_context, ROOT
from vla_edge_ros import params as P
from vla_edge_ros.ros.tools import param_docs


def test_yaml_has_every_parameter_with_registry_default_and_type():
    doc = yaml.safe_load((ROOT / "config" / "runtime.yaml").read_text())
    assert set(doc) == set(P.NODES)
    for node in P.NODES:
        values = doc[node]["ros__parameters"]
        specs = {s.name: s for s in P.for_node(node)}
        assert set(values) == set(specs), f"{node}: yaml {sorted(values)} vs registry {sorted(specs)}"
        for name, value in values.items():
            spec = specs[name]
            assert type(value) is spec.type, f"{node}.{name}: yaml type {type(value).__name__} != {spec.type.__name__}"
            assert value == spec.default, f"{node}.{name}: yaml {value!r} != default {spec.default!r}"
            assert P.validate(name, value) is None


def test_yaml_and_doc_tables_are_generated_from_the_registry():
    assert param_docs.main(["--check"]) == 0, "run: python -m vla_edge_ros.ros.tools.param_docs --write"


def _table_rows(path):
    """(node, parameter) of each row of the generated table in one doc."""
    rows = [r for r in param_docs.table_part(path.read_text()).splitlines() if r.startswith("| vla_")]
    return [(r.split("|")[1].strip(), r.split("|")[2].strip().strip("`")) for r in rows]


def test_every_parameter_is_listed_exactly_once_across_the_doc_tables():
    listed = []
    for path, nodes in param_docs.DOC_TABLES.items():
        rows = _table_rows(path)
        assert {node for node, _ in rows} == set(nodes), f"{path.name} carries the tables of {nodes} only"
        listed += rows
    names = [name for _, name in listed]
    assert sorted(names) == sorted(s.name for s in P.PARAMS), "each parameter once, in README.md or docs/SIM.md"
    for node, name in listed:
        assert P.BY_NAME[name].node == node, f"{name} is listed under {node}"
    assert param_docs.DOC_TABLES[param_docs.README_PATH] == (P.CAMERA, P.INFERENCE, P.ACTION)
    assert param_docs.DOC_TABLES[param_docs.SIM_DOC_PATH] == (P.SIM,)


def test_check_fails_when_a_doc_table_is_stale(tmp_path, monkeypatch):
    stale = {}
    for path, nodes in param_docs.DOC_TABLES.items():
        copy = tmp_path / path.name
        copy.write_text(path.read_text())
        stale[copy] = nodes
    sim_copy = tmp_path / param_docs.SIM_DOC_PATH.name
    text = sim_copy.read_text()
    row = next(r for r in param_docs.table_part(text).splitlines() if "`horizon`" in r)
    sim_copy.write_text(text.replace(row + "\n", ""))  # one parameter lost from docs/SIM.md
    yaml_copy = tmp_path / "runtime.yaml"
    yaml_copy.write_text(param_docs.yaml_text())
    monkeypatch.setattr(param_docs, "DOC_TABLES", stale)
    monkeypatch.setattr(param_docs, "YAML_PATH", yaml_copy)
    monkeypatch.setattr(param_docs, "ROOT", tmp_path)
    assert param_docs.main(["--check"]) == 1
    assert param_docs.main(["--write"]) == 0 and param_docs.main(["--check"]) == 0
    assert "`horizon`" in param_docs.table_part(sim_copy.read_text())


def test_a_doc_without_its_table_markers_is_an_error():
    with pytest.raises(ValueError, match="markers"):
        param_docs.with_table("# a doc with no table\n", (P.SIM,), "docs/SIM.md")


def test_yaml_text_detects_a_changed_default(monkeypatch):
    spec = P.BY_NAME["deadline_ms"]
    changed = tuple(s if s.name != "deadline_ms" else P.ParamSpec(**{**s.__dict__, "default": 40.0})
                    for s in P.PARAMS)
    before = param_docs.yaml_text()
    monkeypatch.setattr(P, "PARAMS", changed)
    monkeypatch.setattr(P, "for_node", lambda node: tuple(s for s in changed if s.node == node))
    assert param_docs.yaml_text() != before
    assert "deadline_ms: 40.0" in param_docs.yaml_text() and spec.default == 33.0


def test_launch_file_choices_match_registry():
    tree = ast.parse((ROOT / "launch" / "runtime.launch.py").read_text())
    consts = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                consts[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    assert tuple(consts["EVICTION_POLICIES"]) == P.EVICTION_POLICIES
    assert tuple(consts["BACKENDS"]) == P.BACKENDS
    assert set(consts["ROLES"]) == {"all", "robot", "edge"}


@pytest.fixture(scope="module")
def ros_nodes(ros_domain, tmp_path_factory):
    pytest.importorskip("rclpy")
    from vla_edge_ros.core.double_buffer import DoubleBuffer
    from vla_edge_ros.ros.action_node import ActionNode
    from vla_edge_ros.ros.camera_node import CameraNode
    from vla_edge_ros.ros.inference_node import InferenceNode

    with rclpy_context(ros_domain, tmp_path_factory.mktemp("ros_home")) as ctx:
        nodes = {P.CAMERA: CameraNode(DoubleBuffer(), context=ctx), P.ACTION: ActionNode(context=ctx),
                 P.INFERENCE: InferenceNode(DoubleBuffer(), context=ctx)}
        try:  # the simulated arm needs the optional 'sim' extra (metaworld)
            import metaworld  # noqa: F401
        except ImportError:
            pass
        else:
            from vla_edge_ros.ros.sim_node import SimNode
            nodes[P.SIM] = SimNode(context=ctx)
        yield nodes
        for n in nodes.values():
            n.destroy_node()


@pytest.mark.parametrize("node_name", P.NODES)
def test_nodes_declare_exactly_the_registry_parameters(ros_nodes, node_name):
    from rcl_interfaces.msg import ParameterType

    if node_name not in ros_nodes:
        pytest.skip(f"{node_name} needs the optional 'sim' extra (metaworld)")
    node = ros_nodes[node_name]
    declared = {n for n in node._parameters if n not in ("use_sim_time", "start_type_description_service")}
    assert declared == {s.name for s in P.for_node(node_name)}
    ros_type = {bool: ParameterType.PARAMETER_BOOL, int: ParameterType.PARAMETER_INTEGER,
                float: ParameterType.PARAMETER_DOUBLE, str: ParameterType.PARAMETER_STRING}
    for spec in P.for_node(node_name):
        d = node.describe_parameter(spec.name)
        assert d.type == ros_type[spec.type]
        assert d.read_only == (not spec.live), spec.name
        assert spec.description.split(" ")[0] in d.description
        assert node.get_parameter(spec.name).value == spec.default
        if spec.type is float and spec.min is not None:
            r = d.floating_point_range[0]
            assert math.isclose(r.from_value, spec.min) and math.isclose(r.to_value, spec.max)
        if spec.type is int and spec.min is not None:
            r = d.integer_range[0]
            assert (r.from_value, r.to_value) == (int(spec.min), int(spec.max))
        if spec.choices:
            assert all(c in d.description for c in spec.choices)
