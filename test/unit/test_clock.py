"""Clock jumps without ROS: JumpWatch against hand-made readings, and what a jump does to the
ages the Assembler judges."""
import pytest

from oxygen_ros.robot.clock import BACK_S, JumpWatch
from oxygen_ros.robot.frames import Assembler


def test_a_clock_that_runs_with_the_monotonic_one_never_jumps():
    w = JumpWatch(forward=0.5)
    assert w.check(100.0, 7.0) is None  # the first reading has nothing to compare with
    for k in range(1, 100):
        # Ticks late or early by a few ms move both clocks alike.
        assert w.check(100.0 + 0.0143 * k, 7.0 + 0.0143 * k) is None


@pytest.mark.parametrize('step, jumped', [
    (-5.0, True), (-2 * BACK_S, True), (-0.5 * BACK_S, False),
    (0.4, False), (0.6, True), (3600.0, True)])
def test_a_step_of_the_clock_beyond_the_thresholds_is_a_jump(step, jumped):
    w = JumpWatch(forward=0.5)
    w.check(100.0, 7.0)
    got = w.check(100.0 + 0.014 + step, 7.014)
    if jumped:
        assert got == pytest.approx(step)
    else:
        assert got is None
    # The next reading compares with the one after the jump, not before it.
    assert w.check(100.028 + step, 7.028) is None


def test_reset_forgets_the_last_reading():
    w = JumpWatch(forward=0.5)
    w.check(100.0, 7.0)
    w.reset()
    assert w.check(50.0, 7.1) is None


@pytest.mark.parametrize('bad', [0.0, -1.0, float('nan'), float('inf')])
def test_thresholds_must_be_finite_and_positive(bad):
    with pytest.raises(ValueError, match='finite and > 0'):
        JumpWatch(forward=bad)
    with pytest.raises(ValueError, match='finite and > 0'):
        JumpWatch(forward=0.5, back=bad)


def assembler():
    return Assembler(['cam', 'joints'], max_input_age=0.5, max_skew=0.1, trigger=['cam'],
                     max_ahead=0.05)


def test_a_sample_from_before_a_backward_jump_is_not_usable():
    a = assembler()
    a.put('cam', 'img', 105.0)
    a.put('joints', 'q', 105.0)
    assert a.ready(105.01)[0] is not None
    # The clock went back 5 s: the samples lie 5 s ahead of it. Their age (-5 s) never
    # reaches max_input_age, so without this the inputs would never count as stale.
    frame, why = a.ready(100.0)
    assert frame is None
    assert 'cam stamped 5000 ms ahead of the clock' in why
    assert a.unusable('joints', 100.0).startswith('stamped 5000 ms ahead')
    # Within max_ahead is fine (a sender's clock a little ahead).
    a.put('cam', 'img', 100.04)
    a.put('joints', 'q', 100.04)
    assert a.unusable('cam', 100.0) is None


def test_clear_restarts_the_inputs():
    a = assembler()
    a.put('cam', 'img', 105.0)
    a.put('joints', 'q', 105.0)
    a.clear()
    frame, why = a.ready(100.0)
    assert frame is None
    assert why == 'cam missing (nothing received yet); joints missing (nothing received yet)'
    a.put('cam', 'img', 100.0)
    a.put('joints', 'q', 100.0)
    frame, why = a.ready(100.01)
    assert why is None and frame.stamp == 100.0


def test_a_thread_preempted_between_the_reads_is_no_jump():
    w = JumpWatch(forward=0.5)
    w.check(100.0, 7.0, 7.0)
    # The clock was read 30 ms after `before` (the thread lost the core in between): the
    # bracket says so, and nothing is called a jump.
    assert w.check(100.044, 7.014, 7.045) is None
    # Read promptly, the same 30 ms gap is a step back of the clock.
    w = JumpWatch(forward=0.5)
    w.check(100.0, 7.0, 7.0)
    assert w.check(100.014, 7.044, 7.0441) == pytest.approx(-0.03, abs=1e-3)
