"""Seconds <-> ROS time, one rule for the whole package.

A time in seconds becomes builtin_interfaces/Time (or Duration) fields by rounding it to the
nearest nanosecond, carrying into the seconds: truncating reads 0.3 s as 0.299999999 s, and
rounding the fraction without the carry reads a sum of substeps such as 2.9999999999996 s as
2 s and 1e9 ns. The whole seconds are split off first because a float has no nanoseconds to
spare at wall-clock times (1.7e9 s): multiplying the whole value by 1e9 would lose tens.
A duration is at least 1 ns: every point the node publishes lies after its trajectory's
start, a point already due included.
"""

import math

NS = 1_000_000_000


def seconds(stamp) -> float:
    """A builtin_interfaces/Time or Duration (anything with sec and nanosec) in seconds."""
    return stamp.sec + stamp.nanosec * 1e-9


def split(t: float) -> tuple[int, int]:
    """Seconds -> (sec, nanosec), the nearest nanosecond."""
    sec = math.floor(t)
    ns = round((t - sec) * 1e9)  # t - sec is exact in binary floating point
    if ns >= NS:
        sec, ns = sec + 1, ns - NS
    return int(sec), int(ns)


def split_duration(dt: float) -> tuple[int, int]:
    """Seconds -> (sec, nanosec) of a duration, at least 1 ns."""
    sec, ns = split(dt)
    return (0, 1) if sec <= 0 and ns < 1 else (sec, ns)
