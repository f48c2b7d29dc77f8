"""The node's control-side arithmetic, without ROS: chunk velocities, which actions are
still ahead, parameter type checks."""
import numpy as np
import pytest

from oxygen_ros.node import PARAMS, StartError, _coerce, make_chunk, problem_key, remaining


def test_chunk_velocities_by_hand():
    pos = np.array([[0.0, 1.0], [1.0, 1.0], [4.0, 0.5]])
    c = make_chunk(10.0, 0.5, pos)
    assert c.stamp == 10.0 and c.period == 0.5
    np.testing.assert_array_equal(c.positions, pos)
    # Central differences inside, one-sided at the start, and the last point at rest.
    np.testing.assert_allclose(c.velocities, [[2.0, 0.0], [4.0, -0.5], [0.0, 0.0]])
    one = make_chunk(0.0, 0.1, [[3.0, 4.0]])
    assert one.velocities.tolist() == [[0.0, 0.0]]


def test_remaining_skips_actions_already_due():
    c = make_chunk(10.0, 0.25, np.zeros((4, 1)))  # actions at 10, 10.25, 10.5, 10.75
    assert remaining(c, 9.0) == 0
    assert remaining(c, 10.0) == 1  # due now: no longer ahead
    assert remaining(c, 10.3) == 2
    assert remaining(c, 10.75) == 4  # used up
    assert remaining(c, 11.0) == 4


def test_problem_key_ignores_numbers():
    a = problem_key('frame', 'cam stale (612 ms old, limit 500 ms)')
    b = problem_key('frame', 'cam stale (1204 ms old, limit 500 ms)')
    assert a == b == 'frame:cam stale (# ms old, limit # ms)'
    assert problem_key('frame', 'wrist stale (1 ms old)') != a


def test_parameter_types_are_checked_by_name():
    spec = {p.name: p for p in PARAMS}
    assert _coerce('control_rate_hz', 70, spec['control_rate_hz']) == 70.0
    assert isinstance(_coerce('control_rate_hz', 70, spec['control_rate_hz']), float)
    assert _coerce('cameras', None, spec['cameras']) == []
    assert _coerce('threads', None, spec['threads']) == 1
    with pytest.raises(StartError, match='parameter threads must be int'):
        _coerce('threads', True, spec['threads'])
    with pytest.raises(StartError, match=r'parameter cameras must be str\[\]'):
        _coerce('cameras', ['a', 3], spec['cameras'])
    with pytest.raises(StartError, match='parameter control_rate_hz must be float'):
        _coerce('control_rate_hz', '70', spec['control_rate_hz'])
