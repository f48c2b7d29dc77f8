"""The control thread's scheduling: real-time (SCHED_FIFO) where the system allows it, else
a lower nice value where that is allowed, else as it was; and the log says which."""
import os
import threading
from types import SimpleNamespace

import pytest

pytest.importorskip('rclpy')
from oxygen_ros.ros import control  # noqa: E402

RESET = getattr(os, 'SCHED_RESET_ON_FORK', 0)


def in_thread(fn):
    """fn() in a new thread, and what that thread then runs at."""
    out = {}

    def run():
        out['result'] = fn()
        out['policy'] = os.sched_getscheduler(0) & ~RESET
        out['priority'] = os.sched_getparam(0).sched_priority
        out['nice'] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out


def refuse(*_args):
    raise PermissionError(1, 'Operation not permitted')


def test_the_thread_runs_at_what_it_says():
    start_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    out = in_thread(control.raise_priority)
    realtime, what = out['result']
    if realtime:
        assert out['policy'] == os.SCHED_FIFO, out
        assert out['priority'] == control.RT_PRIORITY, out
        assert what == f'real-time (SCHED_FIFO, priority {control.RT_PRIORITY})'
    else:
        assert out['policy'] == os.SCHED_OTHER, out
        assert f'SCHED_FIFO priority {control.RT_PRIORITY} refused' in what, what
        assert what.startswith(f'nice {out["nice"]} (' if out['nice'] < start_nice
                               else 'normal priority ('), (what, out)
    # The caller's own thread is left as it was.
    assert os.sched_getscheduler(0) & ~RESET == os.SCHED_OTHER
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == start_nice


def test_refused_real_time_falls_back_to_nice_where_allowed(monkeypatch):
    monkeypatch.setattr(os, 'sched_setscheduler', refuse)
    start_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    out = in_thread(control.raise_priority)
    realtime, what = out['result']
    assert not realtime and out['policy'] == os.SCHED_OTHER, out
    refused = (f'SCHED_FIFO priority {control.RT_PRIORITY} refused: Operation not permitted')
    if out['nice'] < start_nice:  # this process may lower its threads' nice (root here)
        assert out['nice'] == control.NICE, out
        assert what == f'nice {control.NICE} ({refused})', what
    else:
        assert what.startswith(f'normal priority ({refused}; nice {control.NICE}: '), what


def test_nothing_allowed_leaves_the_thread_as_it_was(monkeypatch):
    monkeypatch.setattr(os, 'sched_setscheduler', refuse)
    monkeypatch.setattr(os, 'setpriority', refuse)
    start_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    out = in_thread(control.raise_priority)
    assert out['result'] == (False, (
        f'normal priority (SCHED_FIFO priority {control.RT_PRIORITY} refused: Operation not '
        f'permitted; nice {control.NICE}: Operation not permitted)'))
    assert out['policy'] == os.SCHED_OTHER and out['nice'] == start_nice, out


def test_a_thread_started_real_time_is_not_lowered(monkeypatch):
    # Started under `chrt -f 20`, say: the thread keeps what it has.
    monkeypatch.setattr(os, 'sched_getscheduler', lambda _pid: os.SCHED_FIFO)
    monkeypatch.setattr(os, 'sched_getparam', lambda _pid: os.sched_param(20))
    monkeypatch.setattr(os, 'sched_setscheduler', refuse)
    assert control.raise_priority() == (True, 'real-time (SCHED_FIFO, priority 20, as started)')


class Log:
    def __init__(self):
        self.lines = []

    def info(self, m):
        self.lines.append(('info', m))

    def warning(self, m):
        self.lines.append(('warning', m))


class Link:
    """What Control's loop reads of a RobotLink before its first tick."""

    def __init__(self):
        self.log = Log()
        self.cfg = SimpleNamespace(p=SimpleNamespace(control_rate_hz=70.0))

    def label(self):
        return 'robot left: '


def run_loop(link, stop):
    c = control.Control(link)
    t = threading.Thread(target=c._control, args=(stop,))
    t.start()
    t.join(5)
    assert not t.is_alive()
    return c


def test_the_loop_says_what_its_thread_runs_at_once():
    link = Link()
    stop = threading.Event()
    stop.set()  # no tick: what the loop says before its first
    c = run_loop(link, stop)
    assert len(link.log.lines) == 1, link.log.lines
    level, line = link.log.lines[0]
    assert line.startswith('robot left: control thread'), line
    assert c.scheduling in line
    assert level == ('info' if c.scheduling.startswith('real-time') else 'warning'), line
    # The next activation's thread runs at the same: not said again.
    t = threading.Thread(target=c._control, args=(stop,))
    t.start()
    t.join(5)
    assert len(link.log.lines) == 1, link.log.lines


def test_a_thread_that_cannot_be_real_time_is_a_warning_that_says_how(monkeypatch):
    monkeypatch.setattr(os, 'sched_setscheduler', refuse)
    monkeypatch.setattr(os, 'setpriority', refuse)
    link = Link()
    stop = threading.Event()
    stop.set()
    run_loop(link, stop)
    [(level, line)] = link.log.lines
    assert level == 'warning', line
    assert line.startswith('robot left: control thread not real-time: normal priority '
                           f'(SCHED_FIFO priority {control.RT_PRIORITY} refused'), line
    assert f'rtprio {control.RT_PRIORITY}' in line and 'CAP_SYS_NICE' in line, line
