"""Leaving commanding (shadow mode switched on live) against a control tick that comes in
between: once the hold has gone to the controllers, nothing but holds may follow it there,
even when a chunk arrives at that moment. A RobotLink of the shipped sim robot file on a
node of this process (its publishers are real), its control ticks called by hand, one of
them from a second thread exactly when the switch is half done."""
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

rclpy = pytest.importorskip('rclpy')
from support.paths import CONFIG  # noqa: E402
from support.robots import robot_config  # noqa: E402

from oxygen_ros.robot.playback import make_chunk  # noqa: E402
from oxygen_ros.ros.robot_link import RobotLink  # noqa: E402


@pytest.fixture
def link():
    context = rclpy.Context()
    rclpy.init(context=context)
    node = rclpy.create_node('race', context=context)
    cfg = robot_config('sim.yaml', allow_unlimited=True)
    ln = RobotLink(node, cfg)
    ln.configure()
    ln.activate()
    # What Control.start sets for a control thread on the system clock; the ticks here are
    # called by hand instead.
    ln.control._tick_clock = time.monotonic
    yield ln
    node.destroy_node()
    rclpy.try_shutdown(context=context)


def header(t):
    sec = int(t)
    return SimpleNamespace(stamp=SimpleNamespace(sec=sec, nanosec=int((t - sec) * 1e9)),
                           frame_id='')


def feed(ln, q):
    """Fresh readings of every input, so the tick's stale check lets the chunk play."""
    t = ln.now()
    for cam in ln.cfg.cameras:
        ln.inputs.image(cam, SimpleNamespace(height=4, width=4, encoding='rgb8', step=12,
                                             is_bigendian=0, data=bytes(48),
                                             header=header(t)))
    for src in ln.cfg.joint_topics:
        ln.inputs.joints(src, SimpleNamespace(name=list(ln.cfg.p.joints), position=list(q),
                                              velocity=[], header=header(t)))


def record(ln):
    """Every command the control loop sends: (commanding when sent, hold or None, thread)."""
    sent = []
    publish = ln.control._publish

    def wrapped(cmd):
        sent.append((ln.cfg.p.command, cmd.hold, threading.current_thread().name))
        publish(cmd)

    ln.control._publish = wrapped
    return sent


def chunk(ln, q):
    return make_chunk(ln.now(), ln.cfg.action_period, np.repeat(q[None], 30, 0))


def late_tick_at_the_hold(ln, q):
    """After the switch's own hold tick, a chunk comes from the engine (played while the
    link is active: on_actions' rule) and the control thread ticks: at once, or once the
    switch is done."""
    tick = ln.control.tick
    late = []

    def first_then_race():
        tick()
        if late:
            return
        feed(ln, q)
        with ln.lock:
            if ln.active:
                ln.player.play(chunk(ln, q))
        other = threading.Thread(target=tick, name='late')
        late.append(other)
        other.start()
        other.join(0.3)  # it has run by now, or waits on the tick lock for the switch

    ln.control.tick = first_then_race
    return late


def test_leaving_commanding_sends_no_chunk_to_the_controllers_after_its_hold(link):
    # The sim robot file's start pose: inside every joint's range.
    q = np.array(yaml.safe_load((CONFIG / 'sim.yaml').read_text())['/**']['ros__parameters']
                 ['initial_positions'], float)
    feed(link, q)
    link.player.play(chunk(link, q))
    link.control.tick()
    assert link.commanding()
    sent = record(link)
    late = late_tick_at_the_hold(link, q)
    link.set_command(False)
    late[0].join(5)
    assert not late[0].is_alive()
    names = [s[2] for s in sent]
    assert 'late' in names, sent  # the late tick sent the chunk: to the shadow topics
    hold = [i for i, s in enumerate(sent) if s[0] and s[1] is not None]
    assert hold, sent
    # After the hold, nothing more went to the controllers.
    assert [s for s in sent[hold[-1] + 1:] if s[0]] == [], sent
