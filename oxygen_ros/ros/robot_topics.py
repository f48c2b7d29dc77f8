"""A robot's topics: its cameras and joint states in; its trajectories (or, in shadow mode,
~/shadow), narration and predicted chunks out; and a raw listener on its trajectory topics
for other commanders."""

from __future__ import annotations

from oxygen_ros.robot.limits import describe as describe_limits
from oxygen_ros.robot.shadow import Shadow
from oxygen_ros.ros.commanders import ACTION, TOPIC_SUFFIX, Commanders, unwatched
from oxygen_ros.ros.topics import Polled, join, qos


def create_topics(link):
    """The robot's subscriptions and publishers, made on ``link``'s node (the link keeps
    them: image_subs, traj_pubs, ...), and one log line that says what goes where."""
    from rclpy.duration import Duration
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from sensor_msgs.msg import CompressedImage, Image, JointState
    from std_msgs.msg import Empty, String
    from trajectory_msgs.msg import JointTrajectory

    from oxygen_ros.msg import Narration

    node, cfg, pre = link.node, link.cfg, link.prefix
    priv = link.private
    sub = node.create_subscription
    polled = Polled()
    # Only the newest image of a camera is ever used; joint states are taken every
    # control tick, and 50 deep holds 0.1 s of a 500 Hz stream should a tick run late.
    # A compressed image is decoded when taken (the engine thread, before a frame), so
    # only the newest of each camera is; one that does not decode is dropped there.
    link.image_subs = [
        sub(CompressedImage, join(pre, topic), lambda m, c=cam: link.inputs.compressed(c, m),
            qos(cfg.p.image_qos, 1), callback_group=polled)
        if cam in link.inputs.decoders else
        sub(Image, join(pre, topic), lambda m, c=cam: link.inputs.image(c, m),
            qos(cfg.p.image_qos, 1), callback_group=polled)
        for cam, topic in cfg.cameras.items()]
    link._joint_subs = [sub(JointState, join(pre, topic),
                            lambda m, s=src: link.inputs.joints(s, m),
                            qos(cfg.p.joint_qos, 50), callback_group=polled)
                        for src, topic in cfg.joint_topics.items()]
    link._ros = [*link.image_subs, *link._joint_subs,
                 sub(String, f'{priv}/prompt', link._on_prompt, 10),
                 sub(Empty, f'{priv}/narrate', link._on_narrate, 10)]
    reliable = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
    # A trajectory not delivered within the horizon (at configure) is over: DDS drops it
    # (lifespan) instead of sending it late. Without that, a reliable writer resends
    # what it sent during a network partition once the partition heals, and the
    # controller (stamp 0: start now) would replay a stale hold or chunk, and another
    # node would hear a commander that stopped long ago.
    commands = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE,
                          lifespan=Duration(seconds=cfg.p.max_command_horizon))
    link.traj_pubs = {g.name: node.create_publisher(JointTrajectory, join(pre, g.topic),
                                                    commands)
                      for g in cfg.groups}
    # What else is said on those topics (raw bytes, compared with what this link sent);
    # taken by the node's watchdog and before activation.
    deep_raw = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
    link.others = Commanders(node, link.topics(), link._input_failed)
    for topic in link.others.topics:
        link.others.subs.append(sub(
            JointTrajectory, topic, lambda m, t=topic: link.others.on_heard(t, m),
            deep_raw, callback_group=polled, raw=True))
    link._ros += link.others.subs
    # Goals on the controllers' follow_joint_trajectory actions move the same joints.
    link._ros += link.others.watch_goals(sub)
    deep = QoSProfile(depth=200, reliability=ReliabilityPolicy.RELIABLE)
    link.narration_pub = node.create_publisher(Narration, f'{priv}/narration', deep)
    link.text_pub = node.create_publisher(String, f'{priv}/narration/text', deep)
    link.predicted_pub = (node.create_publisher(JointTrajectory,
                                                f'{priv}/predicted_trajectory', reliable)
                          if cfg.p.publish_predicted else None)
    # Shadow mode (command: false): the same trajectories, where no controller listens.
    link.shadow_pubs = {g.name: node.create_publisher(
        JointTrajectory, f'{priv}/shadow/{g.name}', reliable) for g in cfg.groups}
    names = cfg.output_names
    link.shadow = Shadow([names.get(i) for i in range(cfg.profile.action_dim)])
    link._ros += [*link.traj_pubs.values(), *link.shadow_pubs.values(),
                  link.narration_pub, link.text_pub,
                  *([link.predicted_pub] if link.predicted_pub else [])]
    name = node.resolve_topic_name
    link.log.info(
        f'{link.label()}{cfg.p.robot} robot, model {cfg.p.model}: cameras '
        + ', '.join(f'{c} <- {name(join(pre, t))}'
                    + (' (compressed)' if c in link.inputs.decoders else '')
                    for c, t in cfg.cameras.items())
        + '; joints <- ' + ', '.join(name(join(pre, t)) for t in cfg.joint_topics.values())
        + '; trajectories -> ' + ', '.join(name(join(pre, g.topic)) for g in cfg.groups)
        + f'; control {cfg.p.control_rate_hz:g} Hz, actions every '
        f'{cfg.action_period * 1e3:.1f} ms, commands reach at most '
        f'{cfg.p.max_command_horizon:g} s ahead; '
        + describe_limits(cfg.limits, list(cfg.output_names.values())))
    blind = unwatched(link.others.topics)
    if blind:
        link.log.warning(
            f'{link.label()}trajectory topics {", ".join(blind)} do not end in '
            f'{TOPIC_SUFFIX}: which controller listens is unknown, so a goal on its '
            f'{ACTION} action (MoveIt, ros2 action send_goal) is not seen as another '
            'commander; only trajectories on the topics are')
