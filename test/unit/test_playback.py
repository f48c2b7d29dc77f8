"""Chunk playback without ROS: which points are published at time t, the horizon bound,
play_steps, re-anchoring on the measured state, and holds."""
import math

import numpy as np
import pytest

from oxygen_ros.robot.playback import Player, make_chunk, remaining, replan_at, runs_out


def test_chunk_velocities_by_hand():
    pos = np.array([[0.0, 1.0], [1.0, 1.0], [4.0, 0.5]])
    c = make_chunk(10.0, 0.5, pos)
    assert c.stamp == 10.0 and c.period == 0.5
    np.testing.assert_array_equal(c.positions, pos)
    # One-sided at the start; inside, the harmonic mean of the slopes either side (2 and 6
    # give 3; a pause then a fall, 0 and -1, gives 0); the last point at rest.
    np.testing.assert_allclose(c.velocities, [[2.0, 0.0], [3.0, 0.0], [0.0, 0.0]])
    one = make_chunk(0.0, 0.1, [[3.0, 4.0]])
    assert one.velocities.tolist() == [[0.0, 0.0]]
    with pytest.raises(ValueError, match='a chunk needs'):
        make_chunk(0.0, 0.1, np.zeros((0, 2)))


def test_remaining_skips_actions_already_due():
    c = make_chunk(10.0, 0.25, np.zeros((4, 1)))  # actions at 10, 10.25, 10.5, 10.75
    assert remaining(c, 9.0) == 0
    assert remaining(c, 10.0) == 1  # due now: no longer ahead
    assert remaining(c, 10.3) == 2
    assert remaining(c, 10.75) == 4  # used up
    assert remaining(c, 11.0) == 4


def ramp(n=10, period=0.1, stamp=0.0):
    # Joint 0 at 1, 2, 3, ... ; joint 1 constant 5.
    return make_chunk(stamp, period, np.stack([np.arange(1.0, n + 1), np.full(n, 5.0)], 1))


def hold_at():
    return np.array([0.5, -0.5])


def read_at(t, q=(0.5, -0.5)):
    """A reading of q taken at t (its stamp), as the node's readings come."""
    return lambda: (np.array(q, dtype=float), np.full(len(q), float(t)))


def test_points_ahead_within_the_horizon():
    p = Player(horizon=0.36)
    p.play(ramp())
    cmd = p.tick(0.05, hold_at=hold_at)
    # Actions 1.. at 0.1, 0.2, ... s; 0.05 s in, those up to 0.36 s ahead: 0.1, 0.2, 0.3, 0.4.
    np.testing.assert_allclose(cmd.times, [0.05, 0.15, 0.25, 0.35])
    np.testing.assert_allclose(cmd.positions[:, 0], [2, 3, 4, 5])
    # Slope 1 per 0.1 s = 10/s inside; the last published point at rest.
    np.testing.assert_allclose(cmd.velocities[:, 0], [10, 10, 10, 0])
    assert cmd.hold is None


def test_used_up_chunk_holds_once_where_the_controller_is():
    p = Player(horizon=1.0, hold_after=0.02)
    p.play(ramp(n=3))
    assert p.tick(0.15, hold_at=hold_at).positions[0, 0] == 3  # action 2 still ahead
    # The only reading was taken at 0 s, before anything was sent: the arm went on from it.
    cmd = p.tick(0.25, hold_at=read_at(0.0))
    assert cmd.hold == 'action chunk used up before the next one arrived'
    np.testing.assert_array_equal(cmd.times, [0.02])
    # The last command ended at action 2 (3, 5) at 0.2 s: the controller rests there. The
    # reading (0.5, -0.5) is where the arm was long before; holding there would move it.
    np.testing.assert_array_equal(cmd.positions, [[3.0, 5.0]])
    np.testing.assert_array_equal(cmd.velocities, [[0.0, 0.0]])
    assert p.tick(0.3, hold_at=hold_at) is None  # said once
    assert p.tick(0.4, hold_at=hold_at) is None


def hermite(t, p0, v0, p1, v1, h):
    # The controller's cubic between two points, written out independently of limits.py.
    a0, a1 = p0, v0
    a2 = (3 * (p1 - p0) - (2 * v0 + v1) * h) / h ** 2
    a3 = (2 * (p0 - p1) + (v0 + v1) * h) / h ** 3
    return a0 + a1 * t + a2 * t ** 2 + a3 * t ** 3


def test_a_hold_mid_motion_targets_the_setpoint_not_the_last_reading():
    p = Player(horizon=1.0, hold_after=0.02)
    p.play(ramp(n=10))
    first = p.tick(0.05, hold_at=read_at(0.0))  # points at 0.1, 0.2, ... (2, 3, ...) s
    assert p.stop('inputs stale')
    cmd = p.tick(0.12, hold_at=read_at(0.0))  # no newer reading came
    assert cmd.hold == 'inputs stale'
    # 0.07 s into the command: on the cubic from the reading (0.5, at rest) to point 0
    # (2 at 0.05 s, 10/s), then 0.02 s into the segment to point 1 (3 at 0.15 s, 10/s).
    want = hermite(0.02, 2.0, 10.0, 3.0, 10.0, 0.1)
    assert first.positions[0, 0] == 2 and first.velocities[0, 0] == 10
    np.testing.assert_allclose(cmd.positions[0], [want, 5.0])
    np.testing.assert_array_equal(cmd.velocities, [[0.0, 0.0]])
    # A reading of 1.8 taken at 0.1 s, when the setpoint was at s1 = hermite(0.0), puts
    # the arm s - s1 further on now: it lags the setpoint by s1 - 1.8.
    s1 = hermite(0.0, 2.0, 10.0, 3.0, 10.0, 0.1)
    p = Player(horizon=1.0, hold_after=0.02)
    p.play(ramp(n=10))
    p.tick(0.05, hold_at=read_at(0.0))
    p.stop('inputs stale')
    again = p.tick(0.12, hold_at=read_at(0.1, (1.8, 5.0)))
    np.testing.assert_allclose(again.positions[0], [1.8 + want - s1, 5.0])
    # The hold spline rests there, never moving faster than the 10/s it moved at.
    np.testing.assert_allclose(p.setpoint(0.14), [1.8 + want - s1, 5.0])
    assert all(abs(p.moving(t)[0]) <= 10.0 for t in np.linspace(0.12, 0.14, 21))
    # Never beyond both the reading and the setpoint: an arm read 0.5 ahead of its setpoint
    # is not taken to have gone on another 0.2 past it.
    p = Player(horizon=1.0, hold_after=0.02)
    p.play(ramp(n=10))
    p.tick(0.05, hold_at=read_at(0.0))
    p.stop('inputs stale')
    ahead = p.tick(0.12, hold_at=read_at(0.1, (2.5, 5.0)))
    np.testing.assert_allclose(ahead.positions[0], [2.5, 5.0])


def test_a_gripper_stalled_on_an_object_is_held_at_its_setpoint():
    # Joint 1 is a gripper commanded closed (0.0) that stopped at 0.3 on the object it
    # holds; joint 0 an arm at rest at 2. Holding the gripper at its reading would end the
    # squeeze: the object drops (MuJoCo's ALOHA drops the cube so). With keep, it is held
    # where it was commanded; the arm is held as before.
    closed = make_chunk(0.0, 0.1, [[2.0, 0.0], [2.0, 0.0], [2.0, 0.0]])
    for keep, want in ((None, [2.0, 0.3]), (np.array([False, True]), [2.0, 0.0])):
        p = Player(horizon=1.0, hold_after=0.02, keep=keep)
        p.play(closed)
        p.tick(0.05, hold_at=read_at(0.05, (2.0, 0.3)))
        cmd = p.tick(0.35, hold_at=read_at(0.34, (2.0, 0.3)))
        assert cmd.hold == 'action chunk used up before the next one arrived'
        np.testing.assert_allclose(cmd.positions, [want])


def test_a_hold_before_anything_was_sent_takes_a_fresh_reading_or_nothing():
    p = Player(horizon=1.0, hold_after=0.02)
    p.play(ramp(n=1, stamp=0.0))  # its one action is already due at 0.05: nothing to play
    cmd = p.tick(0.05, hold_at=lambda: np.array([0.5, np.nan]))
    assert cmd.hold == 'action chunk used up before the next one arrived'
    # Joint 0 read fresh: held there; joint 1 has no fresh reading: no target (NaN), which
    # the node reports and does not publish.
    assert cmd.positions[0, 0] == 0.5 and np.isnan(cmd.positions[0, 1])


def test_forget_makes_the_next_hold_start_from_a_reading():
    p = Player(horizon=1.0, hold_after=0.02)
    p.play(ramp(n=3))
    p.tick(0.05, hold_at=hold_at)
    p.forget()  # e.g. a new activation: the arm may have been moved since
    assert p.setpoint(0.06) is None
    p.stop('deactivated')
    np.testing.assert_array_equal(p.tick(0.06, hold_at=hold_at).positions, [[0.5, -0.5]])


@pytest.mark.parametrize('n,play_steps', [(5, 0), (5, 3), (5, 9), (1, 0)])
def test_runs_out_is_when_the_player_holds(n, play_steps):
    """What the fleet's planner reads as a chunk's deadline is the moment Player.tick stops
    playing it: a command just before, the hold just after."""
    chunk = ramp(n=n, stamp=2.0)
    end = runs_out(chunk, play_steps)
    assert end == pytest.approx(2.0 + 0.1 * (min(n, play_steps or n) - 1))
    before, after = Player(horizon=1.0, play_steps=play_steps), Player(horizon=1.0,
                                                                       play_steps=play_steps)
    before.play(chunk)
    after.play(chunk)
    if end - 1e-6 >= chunk.stamp:
        assert before.tick(end - 1e-6, hold_at=hold_at).hold is None
    assert after.tick(end + 1e-6, hold_at=hold_at).hold is not None


def test_replan_at_once_n_actions_are_out():
    # Actions at 2.0, 2.1, ...: with replan_after 45 the next frame may start once actions
    # 0..44 are out, at 2.0 + 45 * 0.1; 0, or nothing playing, at once.
    c = make_chunk(2.0, 0.1, np.zeros((50, 2)))
    assert replan_at(c, 45) == pytest.approx(6.5)
    assert replan_at(c, 1) == pytest.approx(2.1)
    assert replan_at(c, 0) == -math.inf
    assert replan_at(None, 45) == -math.inf


def test_play_steps_then_hold_unless_a_newer_chunk():
    p = Player(horizon=1.0, play_steps=3)
    p.play(ramp())
    cmd = p.tick(0.0, hold_at=hold_at)
    np.testing.assert_allclose(cmd.positions[:, 0], [2, 3])  # actions 1, 2 of the first 3
    assert p.tick(0.25, hold_at=hold_at).hold == 'the first 3 actions of the chunk are played'
    p.play(ramp(stamp=0.3))
    np.testing.assert_allclose(p.tick(0.3, hold_at=hold_at).positions[:, 0], [2, 3])
    # A newer chunk before the first 3 are played replaces the old one at once.
    p.play(ramp(stamp=0.35))
    np.testing.assert_allclose(p.tick(0.36, hold_at=hold_at).times, [0.09, 0.19])


def test_stop_replaces_the_chunk_with_one_hold():
    p = Player(horizon=1.0)
    assert not p.stop('inputs stale')  # nothing commanded: nothing to replace
    assert p.tick(0.0, hold_at=hold_at) is None
    p.play(ramp())
    assert p.stop('inputs: wrist stale')
    assert not p.stop('again')
    cmd = p.tick(0.05, hold_at=hold_at)
    assert cmd.hold == 'inputs: wrist stale'
    np.testing.assert_array_equal(cmd.positions, [[0.5, -0.5]])
    assert p.tick(0.06, hold_at=hold_at) is None
    # A new chunk plays again.
    p.play(ramp(stamp=0.1))
    assert p.tick(0.1, hold_at=hold_at).hold is None


def test_a_chunk_that_arrives_before_the_hold_went_out_plays_after_it():
    # A fault stops the robot and the engine's next chunk lands before the control tick:
    # the hold still goes out (the robot is held once), then the chunk plays.
    p, twin = Player(horizon=1.0), Player(horizon=1.0)
    for q in (p, twin):
        q.play(ramp())
        q.tick(0.0, hold_at=hold_at)
        assert q.stop('fault: injected')
    p.play(ramp(stamp=0.1))
    cmd = p.tick(0.1, hold_at=hold_at)
    assert cmd.hold == 'fault: injected'
    # The same hold as without the chunk that came in between.
    np.testing.assert_array_equal(cmd.positions, twin.tick(0.1, hold_at=hold_at).positions)
    after = p.tick(0.11, hold_at=hold_at)
    assert after.hold is None and len(after.positions) > 1


def test_nothing_within_the_horizon_sends_nothing():
    p = Player(horizon=0.05)
    p.play(ramp())
    assert p.tick(0.0, hold_at=hold_at) is None  # the next action is 0.1 s ahead
    assert p.tick(0.06, hold_at=hold_at).times.tolist() == pytest.approx([0.04])


def test_reanchor_on_the_measured_state():
    # A DROID-like chunk: target_i = q_measured + 0.2 * v_i with the model's v.
    v = np.array([[1.0, 0.0], [2.0, 0.0], [3.0, 0.0], [4.0, 0.0]])
    q0 = np.array([10.0, 20.0])
    seen = []

    def reanchor(first, measured):
        seen.append((first, measured.copy()))
        return measured + 0.2 * v[first:]

    c = make_chunk(0.0, 0.1, q0 + 0.2 * v, actions=v, state=q0, reanchor=reanchor)
    assert c.actions is v and c.state is q0
    p = Player(horizon=1.0)
    p.play(c)
    q = np.array([11.0, 19.0])
    cmd = p.tick(0.15, measured=lambda: q, hold_at=hold_at)
    assert seen[-1][0] == 2 and seen[-1][1].tolist() == [11.0, 19.0]
    np.testing.assert_allclose(cmd.positions, [[11.6, 19.0], [11.8, 19.0]])
    # Slope (11.8 - 11.6) / 0.1 = 2/s, and the end at rest.
    np.testing.assert_allclose(cmd.velocities, [[2.0, 0.0], [0.0, 0.0]])
    # Within the same step the targets stay anchored where the step began, however the
    # arm moves meanwhile (DROID reads the joints once per step).
    q = np.array([12.0, 18.0])
    cmd = p.tick(0.18, measured=lambda: q, hold_at=hold_at)
    assert len(seen) == 1
    np.testing.assert_allclose(cmd.positions, [[11.6, 19.0], [11.8, 19.0]])
    # The next step anchors again, on the state measured then.
    cmd = p.tick(0.21, measured=lambda: q, hold_at=hold_at)
    assert seen[-1][0] == 3 and seen[-1][1].tolist() == [12.0, 18.0]
    np.testing.assert_allclose(cmd.positions, [[12.8, 18.0]])
    # Without a measured state the frame's own positions are used.
    p.play(make_chunk(0.0, 0.1, q0 + 0.2 * v, actions=v, state=q0, reanchor=reanchor))
    cmd = p.tick(0.15, measured=lambda: None, hold_at=hold_at)
    np.testing.assert_allclose(cmd.positions[:, 0], [10.6, 10.8])


def test_reanchor_of_the_wrong_shape_is_an_error():
    c = make_chunk(0.0, 0.1, np.zeros((4, 2)), reanchor=lambda first, m: np.zeros((1, 2)))
    p = Player(horizon=1.0)
    p.play(c)
    with pytest.raises(ValueError, match=r'reanchor returned \(1, 2\), expected \(3, 2\)'):
        p.tick(0.05, measured=lambda: np.zeros(2), hold_at=hold_at)


def test_bad_limits():
    with pytest.raises(ValueError):
        Player(horizon=0.0)
    with pytest.raises(ValueError):
        Player(horizon=1.0, play_steps=-1)
