"""wisv_ros messages without rclpy: tensors in message fields (wire) and rosbag2 files (bags)."""
