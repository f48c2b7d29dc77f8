"""Under use_sim_time the node's control follows /clock: a slowed simulation gets no more
commands than its simulated time has control ticks, and a paused one gets none. The same
for a node serving a fleet (its own frame planning runs on the node's clock)."""
import time

import pytest

rclpy = pytest.importorskip('rclpy')
from support.node import (  # noqa: E402
    PARAMS,
    RATE,
    Simulation,  # noqa: E402
    keeps_commanding,
    node_process,
)
from support.process import new_domain, wait_for  # noqa: E402

import oxygen_ros.msg  # noqa: E402, F401 (built by colcon; must import)


@pytest.fixture(scope='module', params=['one robot', 'fleet'])
def sim(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp('sim_time')
    domain = new_domain(221, 232)
    params, ns = dict(PARAMS, use_sim_time=True), ''
    if request.param == 'fleet':  # one robot of a fleet, in its namespace
        params['robots'], ns = ['solo'], '/solo'
    with node_process(tmp, params, domain, 'simulation',
                      lambda node: Simulation(node, ns)) as (proc, s):
        assert wait_for(lambda: len(s.traj) > 20 or proc.poll() is not None, 60), s.log()
        assert proc.poll() is None, s.log()
        s.proc = proc
        yield s


def commanding(sim, speed=1.0):
    """At least LIVE (90%) of the commands of the control ticks of `speed` x wall time."""
    return keeps_commanding(sim.traj, RATE * speed, lambda: sim.proc.poll() is None)


def test_control_follows_the_simulated_clock(sim):
    """Two-sided: at a fifth of wall speed, control on the wall clock would send five times
    the simulated ticks (the upper bound, which a slow machine cannot break: it only sends
    fewer), and a node that dropped ticks would send far fewer (the lower bound, half)."""
    sim.set_speed(0.2)
    try:
        time.sleep(0.5)  # what was sent at full speed has arrived
        assert commanding(sim, 0.2), sim.log()[-2000:]
        start, t0 = len(sim.traj), sim.now()
        time.sleep(5.0)  # 1 s of simulated time: 70 ticks
        n, ticks = len(sim.traj) - start, (sim.now() - t0) * RATE
    finally:
        sim.set_speed(1.0)
    # Slack for the node's clock trailing /clock and ticks at the window's ends.
    assert 0.5 * ticks <= n <= 1.2 * ticks + 5, f'{n} trajectories in {ticks:.0f} simulated ticks'


def test_paused_simulation_gets_no_commands(sim):
    sim.set_speed(0.0)
    time.sleep(0.3)
    try:
        assert sim.rate(1.0) == 0
    finally:
        sim.set_speed(1.0)
    assert commanding(sim), sim.log()[-2000:]
