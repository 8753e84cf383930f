"""``ros2 launch`` glue: the graph of :mod:`wisv_ros.graph.description` as a ``LaunchDescription``.

Used only by ``launch/*.launch.py``; ``launch``, ``launch_ros`` and ``ament_index_python`` are
imported when a launch file calls :func:`launch_description`, so importing this module needs no
ROS. The nodes are made in an ``OpaqueFunction`` from the launch arguments' string values by
:func:`wisv_ros.graph.resolve`, the same function the pip-only launcher
(``python -m wisv_ros.cli.launch``) uses: an empty model argument then really leaves the
parameter file's value alone, and both routes start the same nodes with the same parameters.
"""
from __future__ import annotations

from wisv_ros.graph import description as graph

__all__ = ["launch_description", "node_actions"]


def node_actions(configuration: str, values: dict[str, str]) -> list:
    """``launch_ros.actions.Node`` actions of ``configuration`` for the launch argument ``values``."""
    from launch_ros.actions import Node
    from launch_ros.parameter_descriptions import ParameterValue

    actions = []
    for node in graph.resolve(configuration, values):
        # Strings stay strings: launch_ros would read a plain str value as YAML ("on" -> true).
        overrides = {k: ParameterValue(v, value_type=str) if isinstance(v, str) else v
                     for k, v in node.parameters.items()}
        actions.append(Node(
            package=node.package,
            executable=node.executable,
            name=node.name,
            namespace=node.namespace,
            parameters=[node.params_file, overrides],
            remappings=list(node.remappings),
            output="screen",
            **({"ros_arguments": ["--enclave", node.enclave], "additional_env": dict(node.env)} if node.enclave else {}),
        ))
    return actions


def launch_description(configuration: str):
    """The ``LaunchDescription`` of ``configuration``: its launch arguments, then its nodes."""
    from launch import LaunchDescription
    from launch.actions import DeclareLaunchArgument, OpaqueFunction

    arguments = graph.launch_arguments(configuration)

    def make_nodes(context, *_args, **_kwargs):
        values = {a.name: context.launch_configurations.get(a.name, a.default) for a in arguments}
        return node_actions(configuration, values)

    return LaunchDescription(
        [DeclareLaunchArgument(a.name, default_value=a.default, description=a.description) for a in arguments]
        + [OpaqueFunction(function=make_nodes)]
    )
