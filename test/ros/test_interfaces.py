"""The node's interface list (oxygen_ros.ros.interfaces), which its SROS2 policy grants,
against what a running node advertises on the ROS graph: the installed node as its own
process, configured and commanding, remapped and with every optional topic on; the list
written by the installed oxygen_policy for the same parameters and remappings."""
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

rclpy = pytest.importorskip('rclpy')
from support.node import PARAMS, User, assert_alive_and_commanding, node_process  # noqa: E402
from support.process import node_env, wait_for, write_params  # noqa: E402

from oxygen_ros.ros.interfaces import Interface, on_graph  # noqa: E402

# The front camera remapped (the fake robot publishes it there), the predicted trajectory on.
NODE = dict(PARAMS, publish_predicted=True)
REMAP = ['-r', 'front/image:=/remapped/front']


def policy_tool(tmp_path, domain, *extra):
    params = write_params(tmp_path / 'policy_params.yaml', NODE)
    return subprocess.run(
        [sys.executable, '-m', 'oxygen_ros.ros.interfaces', *extra, '--ros-args',
         '--params-file', params, *REMAP],
        capture_output=True, text=True, timeout=120, env=node_env(domain))


def advertised(node):
    """What the graph shows of /oxygen_node: {kind: {(name, type)}}."""
    by = {'publish': node.get_publisher_names_and_types_by_node,
          'subscribe': node.get_subscriber_names_and_types_by_node,
          'reply': node.get_service_names_and_types_by_node,
          'request': node.get_client_names_and_types_by_node}
    return {k: {(name, t) for name, types in f('oxygen_node', '/') for t in types}
            for k, f in by.items()}


def test_the_interface_list_is_what_a_running_node_advertises(tmp_path, domain):
    out = policy_tool(tmp_path, domain, '--list')
    assert out.returncode == 0, out.stderr
    listed = [Interface(*line.split(' ')) for line in out.stdout.splitlines()]
    expected = on_graph(listed)
    expected['request'] = set()  # the node calls no service
    # Spot checks that the remapping and the fleet-less names are resolved.
    names = {i.name for i in listed}
    assert '/remapped/front' in names and '/front/image' not in names
    assert '/oxygen_node/ask' in names and '/oxygen_node/predicted_trajectory' in names
    assert '/arm_controller/follow_joint_trajectory/_action/status' in names

    with node_process(tmp_path, NODE, domain, 'graph_reader', User, *REMAP) as (proc, robot):
        robot.proc = proc
        assert_alive_and_commanding(robot, NODE)
        seen = {}

        def same():
            seen.update(advertised(robot.node))
            return seen == expected

        wait_for(same, 20, step=0.5)
        for kind in expected:
            assert seen[kind] == expected[kind], (
                kind, 'advertised, not listed:', sorted(seen[kind] - expected[kind]),
                'listed, not advertised:', sorted(expected[kind] - seen[kind]))


def test_the_policy_grants_exactly_the_list(tmp_path, domain):
    listed = policy_tool(tmp_path, domain, '--list')
    assert listed.returncode == 0, listed.stderr
    out = policy_tool(tmp_path, domain, '--enclave', '/robots/arm1')
    assert out.returncode == 0, out.stderr
    root = ET.fromstring(out.stdout)
    assert root.tag == 'policy' and root.get('version') == '0.2.0'
    enclave = root.find('enclaves/enclave')
    assert enclave.get('path') == '/robots/arm1'
    profile = enclave.find('profiles/profile')
    assert (profile.get('ns'), profile.get('node')) == ('/', 'oxygen_node')
    granted = set()
    for group in profile:
        (rule, allow), = group.attrib.items()
        assert allow == 'ALLOW'
        granted |= {(rule, item.text) for item in group}
    want = {(line.split(' ')[0], line.split(' ')[1]) for line in listed.stdout.splitlines()}
    assert granted == want


def test_a_robot_file_the_node_refuses_is_an_error_of_the_tool_too(tmp_path, domain):
    params = write_params(tmp_path / 'bad.yaml', dict(NODE, control_rate_hz=-1.0))
    out = subprocess.run(
        [sys.executable, '-m', 'oxygen_ros.ros.interfaces', '--ros-args', '--params-file',
         params], capture_output=True, text=True, timeout=120, env=node_env(domain))
    assert out.returncode == 1
    assert out.stderr.startswith('[oxygen_policy] error: ') and 'control_rate_hz' in out.stderr
    assert 'Traceback' not in out.stderr
