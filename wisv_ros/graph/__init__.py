"""The node graph: which nodes run in each configuration (description) and its ros2 launch form."""
