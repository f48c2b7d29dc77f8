"""A hold keeps a gripper's grip, on MuJoCo's ALOHA: the scripted transfer-cube episode is
played until the right gripper has the cube in the air, the node's Player (with the shipped
aloha.yaml's `hold` per output group) sends the chunk it was playing and then a hold, and the
simulator carries that hold out for half a second. Held where it was commanded, the gripper
keeps squeezing and the cube stays in it; held at its reading (the arms' rule), it opens to
the cube's width and the cube falls, which is what the setting is for.

Needs the simulator (requirements-mujoco.txt: tools/ws.sh sim-setup; make test installs it
where skips fail the run)."""
import os

import numpy as np
import pytest
from support.robots import robot_config  # noqa: E402

os.environ.setdefault('MUJOCO_GL', 'egl')
pytest.importorskip('gym_aloha', reason='the simulator is not installed (tools/ws.sh sim-setup)')

from oxygen_ros.robot.aloha import (  # noqa: E402
    finger_from_normalized,
    gripper_from_finger,
    normalized_from_gripper,
)
from oxygen_ros.robot.playback import Player, make_chunk  # noqa: E402
from oxygen_ros.sim.aloha_sim import DT, AlohaSim  # noqa: E402
from oxygen_ros.sim.demos import Kinematics, Observer, plan_actions  # noqa: E402

GRIPPERS = [6, 13]
LIFTED = 200  # the script's lifting phase: the cube is in the right gripper, in the air
HOLD_STEPS = 25  # 0.5 s



def servo(actions: np.ndarray) -> np.ndarray:
    """gym-aloha actions (normalised grippers) -> the node's targets (servo angles)."""
    t = np.array(actions, float)
    t[..., GRIPPERS] = gripper_from_finger(finger_from_normalized(t[..., GRIPPERS]))
    return t


def reading(sim: AlohaSim, now: float):
    """The joints as the node reads them for a hold: grippers as servo angles."""
    q = sim.state()
    q[GRIPPERS] = gripper_from_finger(q[GRIPPERS])
    return lambda: (q, np.full(len(q), now))


def held_after_a_hold(keep) -> dict:
    sim = AlohaSim('transfer_cube', 64, 48)
    sim.reset(1000)
    script = plan_actions(sim, Kinematics(sim.physics.model.ptr))
    observer = Observer(sim)
    for a in script[:LIFTED]:
        sim.step(a)
    before = observer.facts()
    assert before['cube_in_right'] and before['cube_lifted'], before
    # The node plays the script's next actions as a chunk for a few steps, then holds.
    player = Player(horizon=0.5, hold_after=DT, keep=keep)
    player.play(make_chunk(sim.time, DT, servo(script[LIFTED:LIFTED + 10])))
    for a in script[LIFTED:LIFTED + 3]:
        assert player.tick(sim.time + 0.001, hold_at=reading(sim, sim.time)).hold is None
        sim.step(a)
    assert player.stop('inputs stale')
    hold = player.tick(sim.time + 0.001, hold_at=reading(sim, sim.time))
    assert hold.hold == 'inputs stale'
    target = np.array(hold.positions[-1], float)
    target[GRIPPERS] = normalized_from_gripper(target[GRIPPERS])
    for _ in range(HOLD_STEPS):
        sim.step(target)
    return observer.facts()


def test_a_hold_keeps_the_cube_in_the_gripper():
    keep = robot_config('aloha.yaml').hold_setpoint
    assert np.flatnonzero(keep).tolist() == GRIPPERS
    after = held_after_a_hold(keep)
    assert after['cube_in_right'] and after['cube_lifted'], after
    # The arms' rule for the grippers too: the squeeze ends and the cube falls.
    dropped = held_after_a_hold(None)
    assert not (dropped['cube_in_right'] and dropped['cube_lifted']), dropped
