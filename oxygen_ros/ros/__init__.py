"""The ROS 2 side: the node, each robot's link (subscriptions, publishers, control thread),
the ~/ask server and client, launch helpers and fleet files."""
