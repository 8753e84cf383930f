"""The installed parameter files (config/*.yaml) agree with the parameters the nodes declare: every YAML
entry is a declared parameter whose value equals the declared default, or an intended override listed
here with its reason."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
import yaml

pytest.importorskip("rclpy")

ROOT = Path(__file__).resolve().parents[1]

# (node, parameter) -> why the YAML sets another value than the code's default
OVERRIDES: dict[tuple[str, str], str] = {}


def declared_defaults(module_name: str) -> dict:
    """name -> default of every ``declare(self, name, default, ...)`` in a node module."""
    from wisv_ros.link.channel import SCENARIOS
    from wisv_ros.sd.models import DEFAULT_DRAFTER, DEFAULT_TARGET
    from wisv_ros.sd.rounds import RobotPolicy

    module = importlib.import_module(module_name)
    ns = dict(vars(module), p=RobotPolicy(), DEFAULT_DRAFTER=DEFAULT_DRAFTER, DEFAULT_TARGET=DEFAULT_TARGET,
              SCENARIOS=SCENARIOS)
    out = {}
    for node in ast.walk(ast.parse(Path(module.__file__).read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "declare":
            name = ast.literal_eval(node.args[1])
            out[name] = eval(compile(ast.Expression(node.args[2]), module.__file__, "eval"), ns)  # noqa: S307
    return out


@pytest.mark.parametrize("node,yaml_file", [("drafter_node", "drafter.yaml"), ("verifier_node", "verifier.yaml")])
def test_yaml_entries_equal_the_declared_defaults(node, yaml_file):
    declared = declared_defaults(f"wisv_ros.nodes.{node}")
    assert len(declared) > 10
    params = yaml.safe_load((ROOT / "config" / yaml_file).read_text())[f"/**/{node}"]["ros__parameters"]
    unknown = sorted(set(params) - set(declared))
    assert not unknown, f"{yaml_file}: not parameters of {node}: {unknown}"
    differ = {name: (value, declared[name]) for name, value in params.items()
              if value != declared[name] and (node, name) not in OVERRIDES}
    assert not differ, f"{yaml_file} (value, declared default): {differ}"
    for (n, name), _why in OVERRIDES.items():
        if n == node:
            assert params[name] != declared[name], f"override {name} is now the default: remove it from OVERRIDES"
