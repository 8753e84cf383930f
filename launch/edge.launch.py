"""ros2 launch wisv_ros edge.launch.py [argument:=value ...]

Starts the edge server: verifier_node and the edge-side link_monitor in /edge, link topics
remapped into the robot's namespace. The graph is described once, in wisv_ros/graph.py; `python -m
wisv_ros.cli.launch edge` starts the same nodes without ROS 2 launch. `ros2 launch wisv_ros
edge.launch.py --show-args` lists the arguments.
"""
from wisv_ros.graph.ros_launch import launch_description


def generate_launch_description():
    return launch_description("edge")
