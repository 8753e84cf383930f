"""Speculative decoding core (ROS-free): the model wrapper, drafter, verifier, acceptance rules, the round protocol and metrics."""
