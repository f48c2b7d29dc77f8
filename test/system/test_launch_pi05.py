"""pi05.launch.py under launch_testing: the installed launch file, included as a user's own
launch file would (robot:=sim sim:=true on the tiny model, namespace lt), starts both nodes;
trajectories keep arriving, and on shutdown both processes exit cleanly.

launch_testing's pytest plugin runs this file as one test (the launch_test mark).
"""
import importlib.util
import os
import tempfile
import threading
import time
import unittest

import pytest
import yaml
from support.launch import tiny_sim_file  # noqa: E402
from support.process import new_domain  # noqa: E402

HAVE_LAUNCH_TESTING = importlib.util.find_spec('launch_testing') is not None
NO_LAUNCH = ('launch_testing is not installed (PyPI has no ROS 2 launch wheels; tools/ws.sh '
             'builds it when OXYGEN_ROS_OVERLAY_SRC names ros-jazzy-overlay-src.tar.gz)')

if not HAVE_LAUNCH_TESTING:
    # A module without any test fails under colcon test (pytest exit code 5), so a stand-in
    # reports the skip and its reason.
    @pytest.mark.skip(reason=NO_LAUNCH)
    def test_pi05_launch():
        pass

else:
    import launch.actions
    import launch.launch_description_sources
    import launch_testing.actions
    import launch_testing.asserts
    import rclpy
    from ament_index_python.packages import get_package_share_directory
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from support.node import keeps_commanding
    from trajectory_msgs.msg import JointTrajectory

    TOPIC = '/lt/fr3_arm_controller/joint_trajectory'

    @pytest.mark.launch_test
    def generate_test_description():
        # The launched processes inherit the environment: a domain of this run's own.
        os.environ['ROS_DOMAIN_ID'] = new_domain(120, 220)
        os.environ.setdefault('ROS_AUTOMATIC_DISCOVERY_RANGE', 'LOCALHOST')
        os.environ['OMP_NUM_THREADS'] = '1'
        share = get_package_share_directory('oxygen_ros')
        # The sim robot file on the tiny model, so the nodes start fast.
        params = str(tiny_sim_file(tempfile.mkdtemp(prefix='launch_pi05_')))
        pi05 = launch.actions.IncludeLaunchDescription(
            launch.launch_description_sources.PythonLaunchDescriptionSource(
                os.path.join(share, 'launch', 'pi05.launch.py')),
            launch_arguments={'robot': 'sim', 'sim': 'true', 'params_file': params,
                              'device': 'cpu', 'namespace': 'lt'}.items())
        return launch.LaunchDescription([pi05, launch_testing.actions.ReadyToTest()])

    class TestTrajectories(unittest.TestCase):

        def test_trajectories_keep_arriving(self):
            ctx = rclpy.Context()
            rclpy.init(context=ctx)
            node = rclpy.create_node('launch_pi05_listener', context=ctx)
            stamps = []
            reliable = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
            node.create_subscription(JointTrajectory, TOPIC,
                                     lambda m: stamps.append(time.monotonic()), reliable)
            ex = SingleThreadedExecutor(context=ctx)
            ex.add_node(node)
            threading.Thread(target=ex.spin, daemon=True).start()
            try:
                end = time.monotonic() + 90
                while not stamps and time.monotonic() < end:
                    time.sleep(0.1)
                self.assertTrue(stamps, f'no trajectory on {TOPIC} in 90 s')
                # The node keeps making and playing chunks at 90% of its control rate or more;
                # the rate itself is tools/node_load.py's.
                share = get_package_share_directory('oxygen_ros')
                sim = yaml.safe_load(open(os.path.join(share, 'config', 'sim.yaml')))
                rate_hz = sim['/**']['ros__parameters']['control_rate_hz']
                commanding = keeps_commanding(stamps, rate_hz)
            finally:
                ex.shutdown(timeout_sec=1)
                node.destroy_node()
                rclpy.try_shutdown(context=ctx)
            self.assertTrue(commanding, f'under 90% of {rate_hz:g} Hz: {len(stamps)} '
                            'trajectories in all')

    @launch_testing.post_shutdown_test()
    class TestShutdown(unittest.TestCase):

        def test_both_processes_exit_cleanly(self, proc_info, proc_output):
            names = sorted(n.rsplit('-', 1)[0] for n in proc_info.process_names())
            self.assertEqual(names, ['oxygen_node', 'oxygen_sim_robot'])
            launch_testing.asserts.assertExitCodes(proc_info)
            for name in proc_info.process_names():
                text = ''.join(o.text.decode(errors='replace') for o in proc_output[name])
                self.assertNotIn('Traceback', text, name)
