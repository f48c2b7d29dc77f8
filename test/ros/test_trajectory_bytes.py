"""Trajectories serialized directly (messages.TrajectoryBytes) are read by the middleware as
the message messages.trajectory builds; where it would read them otherwise, the control loop
serializes the message instead."""
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip('rclpy')
from rclpy.serialization import deserialize_message, serialize_message  # noqa: E402
from trajectory_msgs.msg import JointTrajectory  # noqa: E402

from oxygen_ros.ros import control, messages  # noqa: E402


def read(data: bytes) -> JointTrajectory:
    return deserialize_message(data, JointTrajectory)


@pytest.mark.parametrize('seed', range(40))
def test_bytes_read_back_as_the_message(seed):
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(1, 11)), int(rng.integers(1, 10))
    # Names of every length mod 4 (the strings' padding), and a robot's usual ones.
    joints = [f'{"j" * int(rng.integers(1, 9))}_{i}' for i in range(k)]
    if seed == 0:
        joints = [f'fr3_joint{i}' for i in range(1, 8)]
        n, k = 7, 7
    pos = rng.standard_normal((n, k)) * 10.0 ** rng.integers(-3, 4)
    vel = rng.standard_normal((n, k))
    vel[-1] = -0.0
    times = np.sort(rng.uniform(1e-4, 3.0, n))
    want = messages.trajectory(joints, pos, vel, times)
    got = read(messages.TrajectoryBytes(joints)(pos, vel, times))
    assert got == want, (got, want)
    # And what the middleware makes of its own serialization of it.
    assert read(serialize_message(want)) == got


def test_times_round_as_the_message_does():
    # Below a nanosecond (1 ns), a carry into the seconds, whole seconds, past them.
    times = np.array([1e-12, 0.3, 1.0, 2.9999999999996, 7.25])
    pos = np.arange(10.0).reshape(5, 2)
    got = read(messages.TrajectoryBytes(['a', 'b'])(pos, -pos, times))
    assert got == messages.trajectory(['a', 'b'], pos, -pos, times)
    assert [(p.time_from_start.sec, p.time_from_start.nanosec) for p in got.points] == [
        (0, 1), (0, 300_000_000), (1, 0), (3, 0), (7, 250_000_000)]


def test_column_views_and_one_joint():
    # What the control loop passes: columns of a command, not contiguous.
    rng = np.random.default_rng(7)
    pos, vel = rng.standard_normal((5, 8)), rng.standard_normal((5, 8))
    times = np.arange(1, 6) / 70.0
    for idx, joints in (([7], ['gripper']), ([0, 2, 4], ['a', 'bb', 'ccc'])):
        got = read(messages.TrajectoryBytes(joints)(pos[:, idx], vel[:, idx], times))
        assert got == messages.trajectory(joints, pos[:, idx], vel[:, idx], times)


def test_shapes_that_do_not_match_are_refused():
    write = messages.TrajectoryBytes(['a', 'b'])
    with pytest.raises(ValueError):
        write(np.zeros((2, 3)), np.zeros((2, 3)), [0.1, 0.2])
    with pytest.raises(ValueError):
        write(np.zeros((2, 2)), np.zeros((2, 2)), [0.1])
    with pytest.raises(ValueError):
        messages.TrajectoryBytes([])


def test_control_uses_them_only_where_the_middleware_reads_them_back(monkeypatch):
    group = SimpleNamespace(name='arm', joints=['a', 'b'])
    assert isinstance(control.Control(None)._writer(group), messages.TrajectoryBytes)
    # A middleware that reads them as something else: the message is serialized instead.
    monkeypatch.setattr(control, 'deserialize_message', lambda data, t: JointTrajectory())
    assert control.Control(None)._writer(group) is None
