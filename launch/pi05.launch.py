"""Start oxygen_node for a robot (and, with sim:=true, the simulated robot beside it).

    ros2 launch oxygen_ros pi05.launch.py robot:=aloha checkpoint:=/path/to/pi05_aloha
    ros2 lifecycle set /oxygen_node configure; ros2 lifecycle set /oxygen_node activate

oxygen_node is a lifecycle node: it waits unconfigured for the two transitions above, or
with autostart:=true (config/sim.yaml sets it) configures and activates at once.
Parameters come from config/pi05.yaml (model and engine) then config/<robot>.yaml (topics,
joints, outputs) or params_file; checkpoint, device and autostart override both when given.
Topic names in the configs are relative, so namespace:= and remaps (SetRemap around an
IncludeLaunchDescription of this file) move them. Unless FASTRTPS_DEFAULT_PROFILES_FILE is
set already, both nodes get config/fastdds.xml, whose shared-memory segments fit full-size
camera images (camera drivers need it too; see docs/robots.md).
"""
# ruff would file `launch` under this repository's launch/ folder and sort it last.
import os  # noqa: I001

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import OpaqueFunction
from launch_ros.actions import Node

from oxygen_ros.ros import launch_args


def nodes(context):
    arg = launch_args.values(context, 'robot', 'namespace', 'sim')
    config = os.path.join(get_package_share_directory('oxygen_ros'), 'config')
    robot_file = arg['params_file'] or os.path.join(config, f'{arg["robot"]}.yaml')
    overrides = launch_args.overrides(arg)
    params = [os.path.join(config, 'pi05.yaml'), robot_file, overrides]
    common = dict(namespace=arg['namespace'], **launch_args.process(arg, config))
    out = [Node(package='oxygen_ros', executable='oxygen_node', name='oxygen_node',
                parameters=params, **common)]
    if arg['sim'].lower() == 'true':
        out.append(Node(package='oxygen_ros', executable='oxygen_sim_robot',
                        name='oxygen_sim_robot', parameters=[robot_file, overrides], **common))
    return out


def generate_launch_description():
    return LaunchDescription([
        *launch_args.declare(
            ('robot', 'aloha', 'aloha, droid or sim: picks config/<robot>.yaml'),
            ('namespace', '', 'node namespace'),
            ('sim', 'false', 'also start oxygen_sim_robot on the same topics')),
        OpaqueFunction(function=nodes),
    ])
