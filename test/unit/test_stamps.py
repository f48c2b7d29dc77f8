"""Seconds <-> ROS time (oxygen_ros/robot/stamps.py) against exact decimal arithmetic."""
from decimal import ROUND_HALF_EVEN, Decimal
from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st

from oxygen_ros.robot.stamps import seconds, split, split_duration


def exact(t: float) -> tuple[int, int]:
    """The float's exact value, rounded to whole nanoseconds, split."""
    ns = int((Decimal(t) * 1_000_000_000).quantize(Decimal(1), rounding=ROUND_HALF_EVEN))
    return divmod(ns, 1_000_000_000)


@given(st.floats(min_value=0, max_value=4e9, allow_nan=False))
def test_split_is_the_nearest_nanosecond(t):
    sec, ns = split(t)
    assert 0 <= ns < 1_000_000_000
    frac = (Decimal(t) * 1_000_000_000) % 1
    if abs(frac - Decimal('0.5')) > Decimal('1e-6'):  # a tie may go either way
        assert (sec, ns) == exact(t)


def test_wall_clock_times_keep_their_nanoseconds():
    # 1.7e9 s: the float's own resolution is 238 ns; its exact value is what is rounded.
    t = 1_733_400_000.123456789
    assert split(t) == exact(t)


def test_sums_of_substeps_and_tenths_keep_their_second():
    assert split(sum([0.002] * 1500)) == (3, 0)  # 2.9999999999996 s
    assert split(0.3) == (0, 300_000_000)
    assert split(1.9999999999) == (2, 0)
    assert split(12.5) == (12, 500_000_000)


# Up to 2**22 s (48 days, sim time) a float holds every nanosecond: a stamp comes back.
@given(st.integers(min_value=0, max_value=2**22), st.integers(0, 999_999_999))
def test_a_stamp_comes_back_from_seconds(sec, ns):
    assert split(seconds(SimpleNamespace(sec=sec, nanosec=ns))) == (sec, ns)


def test_a_duration_is_never_zero():
    assert split_duration(0.0) == (0, 1)
    assert split_duration(1 / 70) == (0, 14_285_714)
    assert split_duration(2.5) == (2, 500_000_000)
