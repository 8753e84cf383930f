"""ROS 2 nodes of wisv_ros: thin glue between topics/actions and the ROS-free core.

* ``drafter_node`` (robot): the drafter model, the ``generate`` action, draft blocks up, verdicts down.
* ``verifier_node`` (edge): the target model; verifies draft blocks, publishes verdicts and round stats.
* ``client``: send a Generate goal from Python and collect feedback and result.

Topics are relative names, so a namespace or a remap puts robot and edge on either side of a link
emulator. Every topic uses ``common.RELIABLE_QOS`` (reliable, keep-last 10, volatile): a lost
draft block or verdict would stall a round, and 10 covers the few messages in flight per request.

Importing ``wisv_ros.nodes`` does not import rclpy; the node modules do.
"""
