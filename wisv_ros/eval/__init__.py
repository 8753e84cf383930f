"""Evaluation (ROS-free): data sets (HumanEval, GSM8K, gsm_symbolic), prompts and scoring."""
