"""The bimanual ALOHA simulated in MuJoCo (gym-aloha's scene), on the real robot's topics.

    ros2 run oxygen_ros oxygen_mujoco_aloha --ros-args --params-file config/aloha.yaml \
        --params-file config/aloha_mujoco.yaml

It reads the robot file oxygen_node reads (aloha.yaml: joint_topics, joint_sources, camera
topics, output_groups, outputs.*) and publishes what the Interbotix followers and RealSense
drivers do: a JointState per arm (xs_sdk's names and order: six joints, the `gripper` servo
angle in rad, `left_finger` and `right_finger` in m), each camera as sensor_msgs/Image rgb8.
Each trajectory input behaves like joint_trajectory_controller (aloha_sim.Controller): it
rejects what JTC rejects, with the reason logged, and otherwise interpolates from where the
joints are, holding the last point.

It owns simulated time: it steps the physics (DT = 0.02 s, the controllers sampled every 2 ms
substep), publishes /clock after every step, and paces itself to `real_time_factor` x the wall
clock (0: as fast as it can). Nodes that run with use_sim_time follow it, however slow the
renderer is. A camera is rendered only while something subscribes to it.

~/reset (oxygen_ros/srv/SimReset) starts an episode; ~/step (oxygen_ros/msg/SimStep) carries
each step's task reward. An episode of `steps` > 0 pauses the simulation after its last step
(no /clock, no sensors), as a paused simulator, until the next reset.
"""

from __future__ import annotations

import signal
import threading
import time

import numpy as np

from oxygen_ros.robot.aloha import (
    ARM_JOINTS,
    CAMERAS,
    SIDES,
    finger_from_gripper,
    gripper_from_finger,
)
from oxygen_ros.robot.stamps import seconds, split
from oxygen_ros.sim.aloha_sim import DT, AlohaSim, Controller, Unstable

# xs_sdk's joint_states order for a ViperX 300 6DOF.
JOINT_NAMES = ARM_JOINTS + ['gripper', 'left_finger', 'right_finger']
# Per finger metre, the servo angle's change (the linear map's slope), for velocities.
GRIPPER_PER_FINGER = float(gripper_from_finger(1.0) - gripper_from_finger(0.0))

PARAMS = {
    'task': ('insertion', 'insertion or transfer_cube (gym-aloha scenes)'),
    'seed': (0, 'seed of the first episode'),
    'episode_steps': (0, 'steps of the first episode (0 = no end; ~/reset sets it per episode)'),
    'real_time_factor': (1.0, 'simulated s per wall s at most; 0 = as fast as possible'),
    'open_loop_control': (False, "the controllers start each new trajectory from their last "
                          "command, not the measured state (JTC's open_loop_control)"),
    'camera_rate_hz': (25.0, 'images per camera per simulated second (at most 1/DT)'),
    'image_width': (640, 'rendered width (RealSense colour: 640)'),
    'image_height': (480, 'rendered height'),
    'sim_cameras': (list(CAMERAS), 'cameras to offer (cam_high, cam_low, cam_left_wrist, '
                    'cam_right_wrist)'),
    'cameras': ([], 'the robot file\'s camera names (their topics)'),
    'camera_topics': ([], 'image topic per camera (relative)'),
    'joint_topics': ([], 'JointState topic per arm'),
    'joint_sources': ([], 'left/right per joint topic'),
    'output_groups': ([], 'trajectory inputs (controllers)'),
    'report_every_s': (10.0, 'wall seconds between rate reports in the log'),
}
LISTS = {'sim_cameras', 'cameras', 'camera_topics', 'joint_topics', 'joint_sources',
         'output_groups'}


def camera_topic(camera: str, cameras: list[str], topics: list[str]) -> str:
    if camera in cameras and len(topics) == len(cameras):
        return topics[cameras.index(camera)]
    return f'{camera}/camera/color/image_rect_raw'  # realsense2_camera's colour topic


def side_of(group_joints: list[str], group: str) -> tuple[str, str]:
    """(side, 'arm' | 'gripper') of an output group, from its name (left_arm, ...)."""
    side = 'left' if group.startswith('left') else 'right' if group.startswith('right') else ''
    kind = 'gripper' if group_joints == ['gripper'] else 'arm'
    if not side or (kind == 'arm' and group_joints != ARM_JOINTS):
        raise ValueError(f'output group {group!r} ({group_joints}) is neither an arm '
                         f'({ARM_JOINTS}) nor a gripper ([gripper]) of left or right')
    return side, kind


FACTS = ('cube_in_left', 'cube_in_right', 'cube_lifted', 'cube_touched_elsewhere')


class Scene:
    """The simulation and its controllers, independent of ROS: what the node's loop runs."""

    def __init__(self, task: str, groups: dict[str, tuple[str, str, list[str]]], width: int,
                 height: int, seed: int = 0, open_loop: bool = False):
        self.sim = AlohaSim(task, width, height)
        self.open_loop = open_loop  # the controllers' open_loop_control
        self.task = task
        self.observer = None  # transfer_cube: what the scene says about the cube
        self.groups = groups  # group -> (side, kind, joints)
        self.episode = 0
        self.accepted = 0
        self.rejected = 0
        self.reset(seed)

    def reset(self, seed: int):
        self.sim.reset(seed)
        if self.task == 'transfer_cube' and self.observer is None:
            from oxygen_ros.sim.demos import Observer

            self.observer = Observer(self.sim)
        self.episode += 1
        self.since = self.sim.time  # trajectories stamped before this are stale
        self.controllers = {g: Controller(j, self.measured(side, kind)[0], self.open_loop)
                            for g, (side, kind, j) in self.groups.items()}

    def measured(self, side: str, kind: str) -> tuple[np.ndarray, np.ndarray]:
        """A group's positions and velocities in its controller's units."""
        q, v = self.sim.positions(side), self.sim.velocities(side)
        if kind == 'arm':
            return q[:6], v[:6]
        return gripper_from_finger(q[6:7]), v[6:7] * GRIPPER_PER_FINGER

    def receive(self, group: str, msg) -> str:
        """'' = accepted; else why not."""
        stamp = seconds(msg.header.stamp)
        if 0 < stamp < self.since:
            self.rejected += 1
            return (f'stamped {stamp:.3f} s, before the reset at {self.since:.3f} s: '
                    'meant for the previous episode')
        side, kind, _ = self.groups[group]
        try:
            why = self.controllers[group].receive(msg, self.sim.time, *self.measured(side, kind))
        except (ValueError, TypeError, IndexError) as e:  # a malformed message
            why = f'{type(e).__name__}: {e}'
        self.rejected += bool(why)
        self.accepted += not why
        return why

    def step(self) -> float:
        """One DT: the controllers sampled at each substep. Returns the reward."""
        sim = self.sim
        arm = {s: sim.positions(s)[:6] for s in SIDES}
        finger = {s: sim.positions(s)[6] for s in SIDES}
        dt = sim.physics.timestep()
        for _ in range(sim.substeps):
            t = sim.time + dt  # the command for the end of this substep
            for g, c in self.controllers.items():
                side, kind, _ = self.groups[g]
                target = c.sample(t)
                if kind == 'arm':
                    arm[side] = target
                else:
                    finger[side] = float(finger_from_gripper(target[0]))
            sim.set_targets(arm, finger)
            sim.substep(1)
        return sim.end_step()

    def facts(self) -> dict[str, bool]:
        """SimStep's facts about the cube (all false without a cube)."""
        if self.observer is None:
            return dict.fromkeys(FACTS, False)
        return self.observer.facts()

    def joint_state(self, side: str) -> tuple[list[float], list[float], list[float]]:
        q, v = self.sim.positions(side), self.sim.velocities(side)
        pos = [*q[:6], float(gripper_from_finger(q[6])), q[6], q[7]]
        vel = [*v[:6], v[6] * GRIPPER_PER_FINGER, v[6], v[7]]
        f = self.sim.physics.data.qfrc_actuator
        idx = self.sim.qpos_index
        eff = [float(f[idx[(side, j)]]) for j in ARM_JOINTS]
        eff += [0.0, float(f[idx[(side, 'left_finger')]]), float(f[idx[(side, 'right_finger')]])]
        return [float(x) for x in pos], [float(x) for x in vel], eff


def main(argv=None):
    import rclpy
    from rcl_interfaces.msg import ParameterDescriptor
    from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
    from rclpy.node import Node
    from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
    from rclpy.signals import SignalHandlerOptions
    from rosgraph_msgs.msg import Clock
    from sensor_msgs.msg import Image, JointState
    from trajectory_msgs.msg import JointTrajectory

    from oxygen_ros.msg import SimStep
    from oxygen_ros.sim.aloha_sim import require
    from oxygen_ros.srv import SimReset

    require()

    rclpy.init(args=argv, signal_handler_options=SignalHandlerOptions.NO)
    node = Node('oxygen_mujoco_aloha')
    log = node.get_logger()
    p = {}
    for name, (default, text) in PARAMS.items():
        desc = ParameterDescriptor(description=text, dynamic_typing=True)
        node.declare_parameter(name, default if default != [] else None, desc)
        value = node.get_parameter(name).value
        p[name] = list(value or []) if name in LISTS else value
    groups = {}
    for g in p['output_groups']:
        for key in ('topic', 'joints'):
            node.declare_parameter(f'outputs.{g}.{key}', None,
                                   ParameterDescriptor(dynamic_typing=True))
        topic = node.get_parameter(f'outputs.{g}.topic').value
        joints = list(node.get_parameter(f'outputs.{g}.joints').value or [])
        side, kind = side_of(joints, g)
        groups[g] = (side, kind, joints, topic)
    sources = p['joint_sources'] or SIDES
    if sorted(sources) != SIDES or len(p['joint_topics']) != 2:
        raise SystemExit('oxygen_mujoco_aloha: joint_topics and joint_sources must name the '
                         f'left and right arms, got {p["joint_topics"]} / {sources}')
    scene = Scene(p['task'], {g: v[:3] for g, v in groups.items()}, int(p['image_width']),
                  int(p['image_height']), int(p['seed']), bool(p['open_loop_control']))
    episode_steps = int(p['episode_steps'])

    sensor = qos_profile_sensor_data
    clock_pub = node.create_publisher(Clock, '/clock', 10)
    joint_pubs = {s: node.create_publisher(JointState, t, sensor)
                  for s, t in zip(sources, p['joint_topics'], strict=True)}
    # The RealSense driver publishes reliable; subscribers may take them best effort.
    cam_qos = QoSProfile(depth=2, reliability=ReliabilityPolicy.RELIABLE)
    cams = {}
    for c in p['sim_cameras']:
        if c not in CAMERAS:
            raise SystemExit(f'oxygen_mujoco_aloha: unknown camera {c!r}; the scene has '
                             f'{sorted(CAMERAS)}')
        cams[c] = node.create_publisher(
            Image, camera_topic(c, p['cameras'], p['camera_topics']), cam_qos)
    step_pub = node.create_publisher(SimStep, '~/step',
                                     QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE))

    lock = threading.Lock()
    inbox: list = []  # (group, msg) and ('reset', request, response, event)
    reliable = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
    for g, (_, _, _, topic) in groups.items():
        node.create_subscription(JointTrajectory, topic,
                                 lambda m, g=g: _put(lock, inbox, (g, m)), reliable)

    def on_reset(request, response):
        done = threading.Event()
        _put(lock, inbox, ('reset', request, response, done))
        if not done.wait(30.0):
            response.success, response.message = False, 'the simulation did not answer'
        return response

    node.create_service(SimReset, '~/reset', on_reset)

    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    ex = SingleThreadedExecutor()
    ex.add_node(node)

    def spin():
        try:
            ex.spin()
        except (ExternalShutdownException, Exception):
            pass

    threading.Thread(target=spin, daemon=True).start()
    log.info(f'MuJoCo ALOHA: {p["task"]}, {len(groups)} controllers, cameras '
             f'{", ".join(cams)} at {p["camera_rate_hz"]:g} Hz '
             f'{p["image_width"]}x{p["image_height"]}, real_time_factor {p["real_time_factor"]:g}')

    rtf = float(p['real_time_factor'])
    cam_period = 1.0 / max(1e-6, float(p['camera_rate_hz']))
    paused = False
    step_in_episode = 0
    origin = (time.monotonic(), scene.sim.time)
    report = (time.monotonic(), scene.sim.time, 0, 0)
    renders = 0
    last_cam = -1


    def publish_sensors():
        nonlocal renders, last_cam
        t = scene.sim.time
        st = stamp_msg(t)
        clock_pub.publish(Clock(clock=st))
        for s, pub in joint_pubs.items():
            m = JointState()
            m.header.stamp = st
            m.name = list(JOINT_NAMES)
            m.position, m.velocity, m.effort = scene.joint_state(s)
            pub.publish(m)
        slot = int(t / cam_period + 1e-6)
        if slot != last_cam:
            last_cam = slot
            for c, pub in cams.items():
                if pub.get_subscription_count() == 0:
                    continue
                img = scene.sim.render(c)
                m = Image()
                m.header.stamp = st
                m.header.frame_id = f'{c}_color_optical_frame'
                m.height, m.width = img.shape[:2]
                m.encoding, m.step = 'rgb8', img.shape[1] * 3
                m.data = img.tobytes()
                pub.publish(m)
                renders += 1

    try:
        publish_sensors()
        while not stop.is_set() and rclpy.ok():
            with lock:
                work, inbox[:] = list(inbox), []
            for item in work:
                if item[0] == 'reset':
                    _, req, resp, done = item
                    try:
                        scene.reset(int(req.seed))
                    except ValueError as e:  # numpy's seeds are 0 .. 2**32 - 1
                        resp.success, resp.message = False, f'seed {req.seed}: {e}'
                        done.set()
                        continue
                    episode_steps, step_in_episode, paused = int(req.steps), 0, False
                    resp.success, resp.episode = True, scene.episode
                    resp.stamp = stamp_msg(scene.sim.time)
                    resp.message = f'episode {scene.episode}, seed {req.seed}'
                    origin = (time.monotonic(), scene.sim.time)
                    log.info(f'reset: {resp.message}, {episode_steps or "unbounded"} steps')
                    done.set()
                    publish_sensors()
                else:
                    g, msg = item
                    why = scene.receive(g, msg)
                    if why:
                        log.warning(f'{groups[g][3]}: trajectory rejected: {why}',
                                    throttle_duration_sec=1.0)
            if paused:
                time.sleep(0.005)
                continue
            try:
                reward, unstable = scene.step(), False
            except Unstable as e:  # MuJoCo reset the state: the episode ends, paused
                log.error(f'episode {scene.episode}: the physics diverged ({e}); it ends here '
                          'and the simulation pauses until ~/reset')
                reward, unstable = 0.0, True
            step_in_episode += 1
            done = unstable or (episode_steps > 0 and step_in_episode >= episode_steps)
            publish_sensors()
            m = SimStep()
            m.header.stamp = stamp_msg(scene.sim.time)
            m.episode, m.step, m.reward, m.done = scene.episode, step_in_episode, reward, done
            for k, v in scene.facts().items():
                setattr(m, k, v)
            step_pub.publish(m)
            if done:
                paused = True
                log.info(f'episode {scene.episode} done: {step_in_episode} steps, '
                         f'final reward {reward:g}')
            if rtf > 0:
                ahead = origin[0] + (scene.sim.time - origin[1]) / rtf - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)
                elif ahead < -1.0:  # far behind: do not catch up in a burst
                    origin = (time.monotonic(), scene.sim.time)
            wall = time.monotonic()
            if wall - report[0] >= float(p['report_every_s']):
                dw, ds = wall - report[0], scene.sim.time - report[1]
                steps = round(ds / DT)
                log.info(f'{steps / dw:.1f} steps/s, sim-time factor {ds / dw:.2f}, '
                         f'{(renders - report[3]) / dw:.1f} images/s; trajectories accepted '
                         f'{scene.accepted}, rejected {scene.rejected}')
                report = (wall, scene.sim.time, 0, renders)
    finally:
        ex.shutdown(timeout_sec=1.0)
        node.destroy_node()
        rclpy.try_shutdown()


def stamp_msg(t: float):
    """builtin_interfaces/Time of t s (the step times are sums of 2 ms substeps)."""
    from builtin_interfaces.msg import Time

    sec, ns = split(t)
    return Time(sec=sec, nanosec=ns)


def _put(lock, inbox, item):
    with lock:
        inbox.append(item)


if __name__ == '__main__':
    main()
