"""ros2 launch wisv_ros fleet.launch.py [robots:=N] [scenarios:=<s1>,<s2>,...] [argument:=value ...]

N robots (/robot1 ... /robotN, each a drafter, a link monitor and its own emulated link) and one
edge (/edge: one verifier_node serving every robot on its own topics, one edge link monitor per
robot) on one machine. The graph is described once, in wisv_ros/graph/description.py; `python -m
wisv_ros.cli.launch fleet` starts the same nodes without ROS 2 launch. `ros2 launch wisv_ros
fleet.launch.py --show-args` lists the arguments.
"""
from wisv_ros.graph.ros_launch import launch_description


def generate_launch_description():
    return launch_description("fleet")
