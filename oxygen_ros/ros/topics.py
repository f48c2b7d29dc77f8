"""Small ROS helpers of the robot link: subscriptions its own threads take from, QoS by name,
topic names under a robot's prefix, durations."""

from __future__ import annotations

from rclpy.callback_groups import CallbackGroup

from oxygen_ros.robot.stamps import split_duration


def duration(dt: float):
    from builtin_interfaces.msg import Duration

    sec, ns = split_duration(dt)
    return Duration(sec=sec, nanosec=ns)


class Polled(CallbackGroup):
    """Subscriptions the node's own threads take from (see take()); no executor runs them."""

    def can_execute(self, entity) -> bool:
        return False

    def beginning_execution(self, entity) -> bool:
        return False

    def ending_execution(self, entity) -> None:
        pass


def take(sub, on_error=None) -> int:
    """Run the callback of `sub` on every message waiting, oldest first; returns how many.
    A callback that raises costs that message only: ``on_error(exception)`` is told, and the
    messages after it are still taken (without ``on_error`` the exception propagates)."""
    n = 0
    while True:
        with sub.handle:
            got = sub.handle.take_message(sub.msg_type, sub.raw)
        if got is None:
            return n
        try:
            sub.callback(got[0])
        except Exception as e:
            if on_error is None:
                raise
            on_error(sub, e)
        n += 1


def qos(choice: str, depth: int):
    from rclpy.qos import QoSProfile, ReliabilityPolicy

    # sensor_data is best effort, like rclpy's qos_profile_sensor_data.
    rel = ReliabilityPolicy.RELIABLE if choice == 'reliable' else ReliabilityPolicy.BEST_EFFORT
    return QoSProfile(depth=depth, reliability=rel)


def join(prefix: str, name: str) -> str:
    """A robot file's topic under a robot's prefix; absolute and private names stay."""
    if not prefix or name.startswith(('/', '~')):
        return name
    return f'{prefix.rstrip("/")}/{name}'
