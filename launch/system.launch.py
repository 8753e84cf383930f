"""ros2 launch wisv_ros system.launch.py [argument:=value ...]

Starts robot and edge on one machine with link_emulator_node relaying /robot <-> /edge over an
emulated channel. The graph is described once, in wisv_ros/graph.py; `python -m
wisv_ros.cli.launch system` starts the same nodes without ROS 2 launch. `ros2 launch wisv_ros
system.launch.py --show-args` lists the arguments.
"""
from wisv_ros.graph.ros_launch import launch_description


def generate_launch_description():
    return launch_description("system")
