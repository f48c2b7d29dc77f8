"""One robot without ROS: its parameters and contract, profiles, frame assembly, images, input
rules, playback, limits, shadow comparison, clock jumps and offline replay."""
