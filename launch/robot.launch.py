"""ros2 launch wisv_ros robot.launch.py [argument:=value ...]

Starts the robot: drafter_node and the robot-side link_monitor in /robot. The graph is described
once, in wisv_ros/graph.py; `python -m wisv_ros.cli.launch robot` starts the same nodes without
ROS 2 launch. `ros2 launch wisv_ros robot.launch.py --show-args` lists the arguments.
"""
from wisv_ros.graph.ros_launch import launch_description


def generate_launch_description():
    return launch_description("robot")
