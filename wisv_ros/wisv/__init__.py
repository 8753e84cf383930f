"""WISV (channel-aware semantic verification): mismatch traces, task-driven labels, CSI-aware relabeling, decision-head training (offline) and the head at run time."""
