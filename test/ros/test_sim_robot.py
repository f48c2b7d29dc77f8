"""oxygen_sim_robot's joints: how they follow their targets, and the speed limit that makes
the arm lag on purpose, checked by hand and over rclpy against the running process."""
import contextlib
import os
import random
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

rclpy = pytest.importorskip('rclpy')

from rclpy.executors import SingleThreadedExecutor  # noqa: E402
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data  # noqa: E402
from sensor_msgs.msg import JointState  # noqa: E402
from support.process import node_env  # noqa: E402
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint  # noqa: E402

from oxygen_ros.sim.sim_robot import follow  # noqa: E402


def test_follow_by_hand():
    q, target = np.array([0.0, 1.0]), np.array([1.0, -1.0])
    # First order: dt / time_constant of the way there.
    np.testing.assert_allclose(follow(q, target, 0.01, 0.05, 0.0), [0.2, 0.6])
    # Never past the target when dt exceeds the time constant.
    np.testing.assert_allclose(follow(q, target, 0.2, 0.05, 0.0), target)
    # At most 3 units/s: 0.03 per 10 ms step, either direction.
    np.testing.assert_allclose(follow(q, target, 0.01, 0.05, 3.0), [0.03, 0.97])
    # Below the limit the limit changes nothing.
    np.testing.assert_allclose(follow(q, target, 0.01, 0.05, 100.0), [0.2, 0.6])
    # Joint limits: a speed per joint (inf: none), and never past [lower, upper].
    np.testing.assert_allclose(follow(q, target, 0.01, 0.05, np.array([np.inf, 3.0])),
                               [0.2, 0.97])
    np.testing.assert_allclose(follow(q, target, 0.2, 0.05, 0.0, np.array([-1.0, 0.5]),
                                      np.array([0.4, 2.0])), [0.4, 0.5])


def sim_args(*params):
    ros = ['--ros-args', '-p', 'joints:=[a, b]', '-p', 'output_groups:=[arm]',
           '-p', 'outputs.arm.topic:=arm/joint_trajectory', '-p', 'outputs.arm.indices:=[0, 1]',
           '-p', 'follow_time_s:=0.01', '-p', 'report_every_s:=60.0']
    for p in params:
        ros += ['-p', p]
    return [sys.executable, '-m', 'oxygen_ros.sim.sim_robot', *ros]


def test_negative_speed_ends_with_one_line():
    domain = str(random.randint(120, 220))
    out = subprocess.run(sim_args('max_joint_speed:=-1.0'), capture_output=True, text=True,
                         env=node_env(domain), timeout=60)
    assert out.returncode == 1, out.stdout + out.stderr
    assert '[oxygen_sim_robot] error: max_joint_speed must be >= 0, got -1.0' in out.stderr
    assert 'Traceback' not in out.stderr


@contextlib.contextmanager
def sim_process(tmp_path, name, *params):
    """The sim with `params` as its own process, and a node `name` of ours on its domain;
    `setup(node)` makes our subscriptions and clients before the node spins. Yields the
    node and the sim's log path."""
    domain = str(random.randint(120, 220))
    log = open(tmp_path / 'sim.log', 'w')
    proc = subprocess.Popen(sim_args(*params), stdout=log,
                            stderr=subprocess.STDOUT, env=node_env(domain))
    os.environ['ROS_DOMAIN_ID'] = domain
    context = rclpy.Context()
    rclpy.init(context=context)
    node = rclpy.create_node(name, context=context)
    ex = SingleThreadedExecutor(context=context)
    ex.add_node(node)
    try:
        yield node, lambda: threading.Thread(target=ex.spin, daemon=True).start()
    finally:
        proc.terminate()
        # Bounded: shutdown() without a timeout waits for the spinning thread for ever, and
        # a run once hung there.
        ex.shutdown(timeout_sec=1)
        node.destroy_node()
        rclpy.try_shutdown(context=context)
        proc.wait(timeout=20)
        log.close()


def run_to(tmp_path, target, *params):
    """The sim with `params` sent a trajectory to `target` within 10 ms: the (stamp,
    positions) of the joint states it publishes over the next second."""
    with sim_process(tmp_path, 'lag_check', *params) as (node, spin):
        return follow_to(tmp_path, node, spin, target)


def follow_to(tmp_path, node, spin, target):
    states = []
    node.create_subscription(
        JointState, 'joint_states',
        lambda m: states.append((m.header.stamp.sec + m.header.stamp.nanosec * 1e-9,
                                 list(m.position))),
        qos_profile_sensor_data)
    pub = node.create_publisher(JointTrajectory, 'arm/joint_trajectory',
                                QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE))
    spin()
    end = time.monotonic() + 30
    while (pub.get_subscription_count() == 0 or not states) and time.monotonic() < end:
        time.sleep(0.05)
    assert states, (tmp_path / 'sim.log').read_text()
    msg = JointTrajectory(joint_names=['a', 'b'])
    msg.points = [JointTrajectoryPoint(positions=target)]
    msg.points[0].time_from_start.nanosec = 10_000_000
    pub.publish(msg)
    time.sleep(1.0)
    got = list(states)
    assert len(got) > 20
    return np.array([t for t, _ in got]), np.array([p for _, p in got])


def test_speed_limited_arm_lags_behind_its_target(tmp_path):
    """A trajectory to +-10 units within 10 ms: the arm limited to 0.5 units/s moves no
    faster than that between any two joint states it publishes (by their stamps, the sim's
    step times), keeps moving, and is far from the target a second later."""
    stamps, q = run_to(tmp_path, [10.0, -10.0], 'max_joint_speed:=0.5')
    # The stamps are taken a moment after the step's own clock reading: allow 10 ms of that.
    slack = 0.5 * 0.01
    moved = np.abs(np.diff(q, axis=0))
    assert np.all(moved <= 0.5 * np.diff(stamps)[:, None] + slack), moved.max()
    assert np.all(np.abs(q[-1] - q[0]) <= 0.5 * (stamps[-1] - stamps[0]) + slack)
    assert q[-1, 0] > 0.1 and q[-1, 1] < -0.1  # moving toward the targets
    assert q[-1, 0] < 5.0 and q[-1, 1] > -5.0  # and far behind them


def test_joints_obey_their_limits(tmp_path):
    """joint_limits as in a robot file: joint a stops at its upper limit 0.3, joint b moves
    no faster than 0.5/s toward a target below its range."""
    stamps, q = run_to(tmp_path, [10.0, -10.0], 'outputs.arm.joints:=[a, b]',
                       'joint_limits.arm.a.lower:=-1.0', 'joint_limits.arm.a.upper:=0.3',
                       'joint_limits.arm.b.velocity:=0.5')
    assert q[:, 0].max() == pytest.approx(0.3) and q[-1, 0] == pytest.approx(0.3)
    moved = np.abs(np.diff(q[:, 1]))
    assert np.all(moved <= 0.5 * np.diff(stamps) + 0.005), moved.max()
    assert -0.7 < q[-1, 1] < -0.1


def test_cameras_stop_and_restart_on_publish_images(tmp_path):
    """publish_images:=false stops every camera of the running sim (what a fleet test uses
    as a camera failure), true brings them back; anything else is refused."""
    from rcl_interfaces.msg import Parameter, ParameterType, ParameterValue
    from rcl_interfaces.srv import SetParameters
    from sensor_msgs.msg import Image

    with sim_process(tmp_path, 'camera_check', 'cameras:=[front]',
                     'camera_topics:=[front/image]', 'image_width:=32', 'image_height:=24',
                     'camera_rate_hz:=20.0') as (node, spin):
        images = []
        node.create_subscription(Image, 'front/image',
                                 lambda m: images.append(time.monotonic()),
                                 qos_profile_sensor_data)
        client = node.create_client(SetParameters, '/oxygen_sim_robot/set_parameters')
        spin()

        def set_images(value):
            v = (ParameterValue(type=ParameterType.PARAMETER_BOOL, bool_value=value)
                 if isinstance(value, bool) else
                 ParameterValue(type=ParameterType.PARAMETER_STRING, string_value=value))
            fut = client.call_async(SetParameters.Request(
                parameters=[Parameter(name='publish_images', value=v)]))
            end = time.monotonic() + 10
            while not fut.done() and time.monotonic() < end:
                time.sleep(0.02)
            return fut.result().results[0]

        end = time.monotonic() + 30
        while (len(images) < 5 or not client.service_is_ready()) and time.monotonic() < end:
            time.sleep(0.05)
        assert len(images) >= 5, (tmp_path / 'sim.log').read_text()
        assert set_images(False).successful
        time.sleep(1.0)  # in flight before the change, or still in our queue
        n = len(images)
        time.sleep(1.5)
        assert len(images) == n, 'images still published with publish_images false'
        bad = set_images('no')
        assert not bad.successful and 'true or false' in bad.reason
        assert set_images(True).successful
        end = time.monotonic() + 10
        while len(images) - n < 10 and time.monotonic() < end:
            time.sleep(0.05)
        assert len(images) - n >= 10, 'images did not come back'
