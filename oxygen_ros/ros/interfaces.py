"""Every topic, service and action oxygen_node uses once configured, by the names they
resolve to (namespace, remappings, a fleet's prefixes): what a security policy has to grant
(SROS2: ``oxygen_policy`` writes one from this list) and what test_interfaces checks a
running node against, so the list cannot drift from the code that creates them.

It is read off an OxygenNode that is built but not configured: its parameters and robot
files are checked, no model is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from xml.sax.saxutils import escape

from oxygen_ros.ros.commanders import action_of
from oxygen_ros.ros.topics import join

# What every rclpy node offers: rcl's parameter services and logging, and (Jazzy) the
# type description service.
PARAMETER_SERVICES = ('describe_parameters', 'get_parameter_types', 'get_parameters',
                      'list_parameters', 'set_parameters', 'set_parameters_atomically')
LIFECYCLE_SERVICES = ('change_state', 'get_state', 'get_available_states',
                      'get_available_transitions', 'get_transition_graph')
# An action is, on the graph, three services and two topics under <name>/_action.
ACTION_SERVICES = ('send_goal', 'cancel_goal', 'get_result')
ACTION_TOPICS = ('feedback', 'status')


@dataclass(frozen=True, order=True)
class Interface:
    # 'publish' / 'subscribe' (topics), 'reply' (services offered), 'execute' (actions
    # served): the words of an SROS2 policy.
    kind: str
    name: str  # fully qualified
    type: str  # e.g. sensor_msgs/msg/Image


def node_interfaces(node) -> list[Interface]:
    """Everything ``node`` (an OxygenNode, configured or not) has once configured."""
    topic = node.resolve_topic_name
    service = node.resolve_service_name
    out = [Interface('publish', '/rosout', 'rcl_interfaces/msg/Log'),
           Interface('publish', '/parameter_events', 'rcl_interfaces/msg/ParameterEvent'),
           Interface('publish', topic('~/transition_event'),
                     'lifecycle_msgs/msg/TransitionEvent'),
           Interface('publish', '/diagnostics', 'diagnostic_msgs/msg/DiagnosticArray'),
           Interface('reply', service('~/get_type_description'),
                     'type_description_interfaces/srv/GetTypeDescription')]
    out += [Interface('reply', service(f'~/{s}'), f'rcl_interfaces/srv/{_camel(s)}')
            for s in PARAMETER_SERVICES]
    # rclpy serves the transition graph with the GetAvailableTransitions type.
    out += [Interface('reply', service(f'~/{s}'), 'lifecycle_msgs/srv/' + _camel(
        'get_available_transitions' if s == 'get_transition_graph' else s))
            for s in LIFECYCLE_SERVICES]
    if node.get_parameter('use_sim_time').value:
        out.append(Interface('subscribe', '/clock', 'rosgraph_msgs/msg/Clock'))
    fleet = bool(node.fleet)
    for link in node.links:
        out += _robot(link, topic)
        ask = f'~/{link.name}/ask' if fleet else '~/ask'
        out.append(Interface('execute', service(ask), 'oxygen_ros/action/Ask'))
    return sorted(set(out))


def _robot(link, topic) -> list[Interface]:
    cfg, pre, priv = link.cfg, link.prefix, link.private
    out = []
    for cam, name in cfg.cameras.items():
        kind = 'CompressedImage' if cfg.transports[cam] == 'compressed' else 'Image'
        out.append(Interface('subscribe', topic(join(pre, name)), f'sensor_msgs/msg/{kind}'))
    out += [Interface('subscribe', topic(join(pre, t)), 'sensor_msgs/msg/JointState')
            for t in cfg.joint_topics.values()]
    out += [Interface('subscribe', topic(f'{priv}/prompt'), 'std_msgs/msg/String'),
            Interface('subscribe', topic(f'{priv}/narrate'), 'std_msgs/msg/Empty'),
            Interface('publish', topic(f'{priv}/narration'), 'oxygen_ros/msg/Narration'),
            Interface('publish', topic(f'{priv}/narration/text'), 'std_msgs/msg/String')]
    if cfg.p.publish_predicted:
        out.append(Interface('publish', topic(f'{priv}/predicted_trajectory'),
                             'trajectory_msgs/msg/JointTrajectory'))
    for g in cfg.groups:
        t = topic(join(pre, g.topic))
        # Commanded, and listened to: another commander on it stops this one.
        out += [Interface('publish', t, 'trajectory_msgs/msg/JointTrajectory'),
                Interface('subscribe', t, 'trajectory_msgs/msg/JointTrajectory'),
                Interface('publish', topic(f'{priv}/shadow/{g.name}'),
                          'trajectory_msgs/msg/JointTrajectory')]
        action = action_of(t)
        if action is not None:  # its goals' status: a goal moving the arm is a commander
            out.append(Interface('subscribe', f'{action}/_action/status',
                                 'action_msgs/msg/GoalStatusArray'))
    return out


def on_graph(interfaces: list[Interface]) -> dict[str, set[tuple[str, str]]]:
    """The interfaces as the ROS graph shows them, {'publish' | 'subscribe' | 'reply': {(name,
    type)}}: an action served is its services and topics under <name>/_action."""
    out = {'publish': set(), 'subscribe': set(), 'reply': set()}
    for i in interfaces:
        if i.kind != 'execute':
            out[i.kind].add((i.name, i.type))
            continue
        for s in ACTION_SERVICES:
            kind = 'action_msgs/srv/CancelGoal' if s == 'cancel_goal' else f'{i.type}_{_camel(s)}'
            out['reply'].add((f'{i.name}/_action/{s}', kind))
        out['publish'].add((f'{i.name}/_action/feedback', f'{i.type}_FeedbackMessage'))
        out['publish'].add((f'{i.name}/_action/status', 'action_msgs/msg/GoalStatusArray'))
    return out


# The SROS2 policy's element per kind: (list element, its rule attribute, item element).
POLICY = {'publish': ('topics', 'publish', 'topic'), 'subscribe': ('topics', 'subscribe', 'topic'),
          'reply': ('services', 'reply', 'service'), 'execute': ('actions', 'execute', 'action')}


def policy_xml(interfaces: list[Interface], node_name: str, namespace: str,
               enclave: str) -> str:
    """An SROS2 policy (format 0.2.0, sros2's policy.xsd) granting the node exactly
    ``interfaces``, by their fully qualified names, in one enclave: the input of ``ros2
    security create_permission`` / ``generate_artifacts``."""
    lines = ['<?xml version="1.0" encoding="UTF-8"?>', '<policy version="0.2.0">',
             '  <enclaves>', f'    <enclave path="{escape(enclave)}">', '      <profiles>',
             f'        <profile ns="{escape(namespace)}" node="{escape(node_name)}">']
    for kind, (element, rule, item) in POLICY.items():
        names = sorted({i.name for i in interfaces if i.kind == kind})
        if not names:
            continue
        lines.append(f'          <{element} {rule}="ALLOW">')
        lines += [f'            <{item}>{escape(n)}</{item}>' for n in names]
        lines.append(f'          </{element}>')
    lines += ['        </profile>', '      </profiles>', '    </enclave>', '  </enclaves>',
              '</policy>', '']
    return '\n'.join(lines)


def _camel(snake: str) -> str:
    return ''.join(w.capitalize() for w in snake.split('_'))


def main(args=None) -> int:
    """oxygen_policy: the node's interfaces for the parameters and remappings given after
    --ros-args (the node's own), as an SROS2 policy or, with --list, one per line."""
    import argparse
    import sys

    import rclpy

    from oxygen_ros.robot.params import StartError
    from oxygen_ros.ros.node import OxygenNode

    argv = sys.argv if args is None else args
    parser = argparse.ArgumentParser(
        prog='oxygen_policy',
        description='Write the SROS2 policy of oxygen_node for the parameters and remappings '
        'given after --ros-args (as the node would get them): every topic, service and '
        'action it uses once configured, by resolved name.')
    parser.add_argument('--enclave', default='', help='the enclave path (default: '
                        '/<namespace>/<node name>, as ros2 security expects)')
    parser.add_argument('--list', action='store_true',
                        help='one interface per line (kind name type) instead of the policy')
    parser.add_argument('--out', default='-', help='file to write (default: stdout)')
    ours = rclpy.utilities.remove_ros_args(argv)[1:]
    opts = parser.parse_args(ours)
    try:
        rclpy.init(args=argv)
    except Exception as e:
        print(f'[oxygen_policy] error: {e}', file=sys.stderr)
        return 1
    try:
        node = OxygenNode(argv)
    except StartError as e:
        print(f'[oxygen_policy] error: {e}', file=sys.stderr)
        rclpy.try_shutdown()
        return 1
    try:
        found = node_interfaces(node)
        ns, name = node.get_namespace(), node.get_name()
        if opts.list:
            text = ''.join(f'{i.kind} {i.name} {i.type}\n' for i in found)
        else:
            enclave = opts.enclave or f'{ns.rstrip("/")}/{name}'
            text = policy_xml(found, name, ns, enclave)
    finally:
        node.destroy_node()
        rclpy.try_shutdown()
    if opts.out == '-':
        sys.stdout.write(text)
    else:
        with open(opts.out, 'w') as f:
            f.write(text)
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
