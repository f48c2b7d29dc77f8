"""Taking over an arm that moves: the first trajectory after an activation (or after shadow
mode) starts from the arm's measured motion, and what the controller makes of it keeps the
robot file's limits.

The controller is modelled independently of oxygen_ros (support/jtc.py: Jazzy's
joint_trajectory_controller with positions and velocities given, closed loop, from the
measured position and velocity). Its peak acceleration and jerk are set against the FR3's
limits as config/sim.yaml states them (franka_description's and libfranka's).
"""
import math
import threading

import numpy as np
import pytest
import yaml
from support.jtc import peaks, segments
from support.paths import CONFIG
from support.robots import robot_config

from oxygen_ros.robot.frames import VELOCITY_GAP_S, JointReadings
from oxygen_ros.robot.playback import TAKEOVER_LATE_S, Player, make_chunk

FR3 = yaml.safe_load((CONFIG / 'sim.yaml').read_text())['/**']['ros__parameters']
ARM = FR3['joint_limits']['arm']


def first_command(velocity_known: bool, speed: float = 1.0):
    """The first trajectory the player sends for an FR3 whose joint 1 moves at 1 rad/s when
    the node takes over, to a chunk that wants the arm where it was read (a policy that
    sees it still): (the command, the arm's position and velocity as the controller starts)."""
    cfg = robot_config('sim.yaml')
    rate = cfg.p.control_rate_hz
    player = Player(cfg.p.max_command_horizon, hold_after=1.0 / rate, limits=cfg.limits)
    q0 = np.array(FR3['initial_positions'], float)
    v = np.zeros_like(q0)
    v[0] = speed
    now, read_at = 10.0, 10.0 - 0.01  # the newest reading is 10 ms old
    stamps = np.full_like(q0, read_at)
    measured = (q0, stamps, v if velocity_known else np.full_like(q0, np.nan))
    player.play(make_chunk(now - 0.05, cfg.action_period, np.repeat(q0[None], 30, 0)))
    cmd = player.tick(now, hold_at=lambda: measured)
    return cmd, q0 + v * (now - read_at), v, cfg


def test_the_first_command_brakes_a_moving_arm_within_the_fr3_limits():
    cmd, p, v, cfg = first_command(velocity_known=True)
    assert cmd is not None and cmd.hold is None
    vel, acc, jerk = peaks(segments(p, v, cmd.times, cmd.positions, cmd.velocities))
    names = [f'fr3_joint{i}' for i in range(1, 8)]
    for i, j in enumerate(names):
        assert vel[i] <= ARM[j]['velocity'] * (1 + 1e-6), (j, vel[i])
        assert acc[i] <= ARM[j]['acceleration'] * (1 + 1e-6), (j, acc[i])
        assert jerk[i] <= ARM[j]['jerk'] * (1 + 1e-6), (j, jerk[i])
    # It brakes: the motion goes on past the reading and comes back, at rest at the end.
    assert cmd.positions[0, 0] > p[0] and cmd.velocities[-1, 0] == 0.0


def keeps_limits_late(cmd, p, v):
    """The FR3's limits kept by what the controller makes of `cmd` when it arrives 0 ..
    TAKEOVER_LATE_S late, the arm meanwhile going on from p at v."""
    names = [f'fr3_joint{i}' for i in range(1, 8)]
    for late in np.linspace(0.0, TAKEOVER_LATE_S, 9):
        vel, acc, jerk = peaks(segments(p + v * late, v, cmd.times, cmd.positions,
                                        cmd.velocities))
        for i, j in enumerate(names):
            assert vel[i] <= ARM[j]['velocity'] * (1 + 1e-6), (late, j, vel[i])
            assert acc[i] <= ARM[j]['acceleration'] * (1 + 1e-6), (late, j, acc[i])
            assert jerk[i] <= ARM[j]['jerk'] * (1 + 1e-6), (late, j, jerk[i])


@pytest.mark.parametrize('speed', [1.0, 2.0])
def test_the_first_command_keeps_the_limits_when_it_arrives_late(speed):
    # The controller gets the command some time after the tick planned it, the arm meanwhile
    # moving on as before (the operator's motion, which the command replaces on arrival).
    # Up to TAKEOVER_LATE_S late, the first segment from where the arm then is keeps the
    # FR3's limits. Seen failing before the take-over got its room: 64 rad/s^2 at 2.5 ms
    # late at 1 rad/s (118 at 2 rad/s).
    cmd, p, v, _ = first_command(velocity_known=True, speed=speed)
    keeps_limits_late(cmd, p, v)


def test_a_hold_that_takes_over_brakes_within_the_limits_when_it_arrives_late():
    # The first thing sent may be a hold (the chunk was stopped before any tick: a fault, a
    # stale input): it brakes the moving arm with the same room for a late delivery.
    # Seen failing before (its first point one control period out): 83.5 rad/s^2 at 2.5 ms.
    cfg = robot_config('sim.yaml')
    player = Player(cfg.p.max_command_horizon, hold_after=1.0 / cfg.p.control_rate_hz,
                    limits=cfg.limits)
    q0 = np.array(FR3['initial_positions'], float)
    v = np.zeros_like(q0)
    v[0] = 1.0
    now = 10.0
    player.play(make_chunk(now - 0.05, cfg.action_period, np.repeat(q0[None], 30, 0)))
    assert player.stop('inputs: joints: stale')
    cmd = player.tick(now, hold_at=lambda: (q0, np.full_like(q0, now), v))
    assert cmd is not None and cmd.hold
    assert cmd.velocities[-1].tolist() == [0.0] * len(q0)
    keeps_limits_late(cmd, q0, v)


def test_without_a_velocity_the_motion_is_unknown_and_the_check_sees_it():
    # The same take-over with the velocity unknown (a driver that sends none, and no earlier
    # reading to differentiate): the player plans from rest, and the controller, which
    # starts from the arm's real motion, breaks the acceleration limit. This is what the
    # velocity is for; it also shows the check above can fail.
    cmd, p, v, _ = first_command(velocity_known=False)
    _, acc, _ = peaks(segments(p, v, cmd.times, cmd.positions, cmd.velocities))
    assert acc[0] > ARM['fr3_joint1']['acceleration']


def test_velocities_from_the_driver_else_differentiated_readings():
    r = JointReadings(['a', 'b'])
    r.update({'a': 0.0, 'b': 1.0}, 1.0)
    assert math.isnan(r.velocity('a'))  # one reading: unknown
    r.update({'a': 0.02, 'b': 1.0}, 1.02)
    assert r.velocity('a') == pytest.approx(1.0) and r.velocity('b') == 0.0
    r.update({'a': 0.03, 'b': 1.0}, 1.04, velocities={'a': 0.7})
    assert r.velocity('a') == pytest.approx(0.7)  # the driver's, where it gives one
    assert r.velocity('b') == 0.0
    r.update({'a': 0.5}, 1.04 + VELOCITY_GAP_S + 0.01)
    assert math.isnan(r.velocity('a'))  # a pause in the stream: no velocity
    r.update({'a': 0.6}, 1.2, differentiate=False)
    assert math.isnan(r.velocity('a'))  # after a rebase: a jump is no velocity
    r.clear()
    assert math.isnan(r.velocity('a'))


def test_a_joint_stream_lost_mid_chunk_holds_at_the_next_control_tick():
    # The control thread judges the inputs at every tick while a chunk plays: a joint stream
    # that stops holds the robot once it is max_input_age old, whatever the engine thread is
    # doing (a long frame), instead of when the chunk runs out. The wrist camera is
    # optional here and the other keeps coming: the joints are what goes stale.
    from types import SimpleNamespace

    from oxygen_ros.robot.inputs import Inputs
    from oxygen_ros.robot.intake import Intake
    from oxygen_ros.robot.report import Reporter

    cfg = robot_config('sim.yaml', optional_cameras=['wrist_image_left'])
    clock = [5.0]
    said, held = [], []
    reporter = Reporter(said.append, clock=lambda: clock[0])
    inputs = Inputs(cfg, reporter, lambda: clock[0])
    intake = Intake(cfg, inputs, reporter, lambda: clock[0], held.append, lambda: None,
                    [], threading.Lock())
    intake.player = Player(1.0, hold_after=1.0 / 70)
    joints = list(cfg.p.joints)

    def header(t):
        sec, ns = int(t), int(round((t - int(t)) * 1e9))
        return SimpleNamespace(stamp=SimpleNamespace(sec=sec, nanosec=ns), frame_id='')

    def reading(t, q):
        return SimpleNamespace(name=joints, position=list(q), velocity=[], header=header(t))

    def image(t):
        return SimpleNamespace(height=4, width=4, encoding='rgb8', step=12, is_bigendian=0,
                               data=bytes(48), header=header(t))

    q = np.array(FR3['initial_positions'], float)
    inputs.joints('', reading(5.0, q))  # the one joint source
    intake.player.play(make_chunk(5.0, cfg.action_period, np.repeat(q[None], 60, 0)))  # 4 s
    assert inputs.measured() is not None
    for t in np.arange(5.0, 5.5, 1 / 70):  # fresh enough: the chunk plays on
        clock[0] = t
        inputs.image('exterior_image_1_left', image(t))
        intake.tick_check(t)
    assert held == [], said
    clock[0] = 5.0 + cfg.p.max_input_age + 0.02  # the stream stopped at 5.0
    inputs.image('exterior_image_1_left', image(clock[0]))
    intake.tick_check(clock[0])
    assert held and held[0].startswith('inputs: joints: stale'), held
    # DROID's re-anchoring reads no stale joints either.
    assert inputs.measured() is None
