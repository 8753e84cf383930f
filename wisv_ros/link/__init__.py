"""The wireless link (ROS-free): channel state, scenarios, channel traces, payload bytes and time costs, protocol choice, emulation and estimation."""
