"""Shadow mode's comparison of predictions with the measured motion, without ROS: each
reading against the newest chunk that covers its stamp, once, over the last seconds."""
import numpy as np
import pytest

from oxygen_ros.robot.playback import make_chunk
from oxygen_ros.robot.shadow import Shadow


def chunk(stamp, positions, period=0.1):
    return make_chunk(stamp, period, np.asarray(positions, float))


def test_a_reading_is_set_against_the_last_frame_before_it():
    s = Shadow(['arm/a', 'arm/b'])
    assert s.predicted(1.0) is None
    s.chunk(chunk(1.0, [[0.0, 1.0], [1.0, 1.0], [2.0, 1.0]]))  # 1.0 .. 1.2 s
    assert s.predicted(1.05) == pytest.approx([0.5, 1.0])  # linear between actions
    assert s.predicted(0.99) is None and s.predicted(1.21) is None
    s.chunk(chunk(1.1, [[5.0, 0.0], [5.0, 0.0]]))  # 1.1 .. 1.2 s: a newer frame's
    assert s.predicted(1.15) == pytest.approx([5.0, 0.0])
    assert s.predicted(1.05) == pytest.approx([0.5, 1.0])  # before the newer frame
    s.chunk(chunk(1.3, [[9.0, 9.0]]))  # one action: it reaches 1.3 s only
    assert s.predicted(1.35) is None  # the last frame's prediction does not reach it


def test_errors_per_joint_each_reading_once_once_a_newer_frame_came():
    s = Shadow(['arm/a', None, 'gripper/g'], window_s=1.0)
    zeros = [[0.0, 0.0, 0.0]] * 31  # 3 s of actions, all at 0
    nan = np.nan
    s.chunk(chunk(0.0, zeros))
    s.measured(np.array([0.1, 7.0, 0.5]), np.array([0.5, 0.5, 0.5]))
    s.measured(np.array([0.1, 7.0, 0.5]), np.array([0.5, 0.5, 0.5]))  # the same: not again
    s.measured(np.array([0.3, nan, nan]), np.array([0.9, nan, nan]))  # the gripper not read
    assert s.errors() == {}  # no newer frame yet: its chunk might predict them
    s.chunk(chunk(1.0, [[1.0, 1.0, 1.0]] * 31))
    got = s.errors()
    assert set(got) == {'arm/a', 'gripper/g'}  # index 1 drives nothing
    assert got['arm/a'] == pytest.approx((0.2, 0.3, 2))  # against the frame at 0 s
    assert got['gripper/g'] == pytest.approx((0.5, 0.5, 1))
    # A reading past the window's end: what is older than 1 s before it is forgotten.
    s.measured(np.array([1.0, nan, 0.0]), np.array([2.0, nan, 2.0]))
    s.chunk(chunk(2.5, zeros))
    assert s.errors() == {'arm/a': pytest.approx((0.0, 0.0, 1)),
                          'gripper/g': pytest.approx((1.0, 1.0, 1))}
    # Not reached by the last frame's chunk: not compared.
    s.measured(np.array([9.0, nan, 9.0]), np.array([6.0, nan, 6.0]))
    s.chunk(chunk(7.0, zeros))
    assert s.errors()['arm/a'] == pytest.approx((0.0, 0.0, 1))


def test_commanding_is_refused_until_every_joint_agrees_within_the_margin():
    s = Shadow(['arm/a', 'gripper/g'])
    assert 'no prediction has been compared' in s.disagreement(0.1)
    s.chunk(chunk(0.0, [[0.0, 0.0]] * 11))
    s.measured(np.array([0.05, np.nan]), np.array([0.2, np.nan]))
    s.chunk(chunk(0.25, [[0.0, 0.0]] * 11))
    assert s.disagreement(0.1) == 'no comparison yet for gripper/g'
    s.measured(np.array([np.nan, 0.3]), np.array([np.nan, 0.3]))
    s.chunk(chunk(0.5, [[0.0, 0.0]] * 11))
    why = s.disagreement(0.1)
    assert 'by more than 0.1' in why and 'gripper/g 0.300' in why and 'arm/a' not in why
    assert s.disagreement(0.5) is None
    s.clear()
    assert 'no prediction has been compared' in s.disagreement(0.5)


def test_the_gate_window_ends_now_not_at_the_last_comparison():
    # An agreement measured minutes ago, with no reading compared since, is none now.
    s = Shadow(['arm/a'], window_s=5.0)
    s.chunk(chunk(0.0, [[0.0]] * 31))
    s.measured(np.array([0.01]), np.array([1.0]))
    s.chunk(chunk(2.0, [[0.0]] * 31))
    assert s.disagreement(0.1, now=3.0) is None  # compared 2 s ago: inside the window
    assert s.errors(now=3.0) == {'arm/a': pytest.approx((0.01, 0.01, 1))}
    why = s.disagreement(0.1, now=120.0)
    assert why == ('no prediction has been compared with the measured joints in the last '
                   '5 s (shadow mode needs chunks and fresh joint readings)')
    assert s.errors(now=120.0) == {}
