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
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node


def nodes(context):
    arg = {name: LaunchConfiguration(name).perform(context) for name in (
        'robot', 'params_file', 'checkpoint', 'device', 'autostart', 'namespace',
        'use_sim_time', 'log_level', 'sim')}
    config = os.path.join(get_package_share_directory('oxygen_ros'), 'config')
    robot_file = arg['params_file'] or os.path.join(config, f'{arg["robot"]}.yaml')
    overrides = {'use_sim_time': arg['use_sim_time'].lower() == 'true'}
    # Only what was given on the command line overrides the files.
    for name in ('checkpoint', 'device'):
        if arg[name]:
            overrides[name] = arg[name]
    if arg['autostart']:
        if arg['autostart'] not in ('true', 'false'):
            raise ValueError(f'autostart:={arg["autostart"]} must be true or false')
        overrides['autostart'] = arg['autostart'] == 'true'
    params = [os.path.join(config, 'pi05.yaml'), robot_file, overrides]
    env = {}
    if not os.environ.get('FASTRTPS_DEFAULT_PROFILES_FILE'):
        env['FASTRTPS_DEFAULT_PROFILES_FILE'] = os.path.join(config, 'fastdds.xml')
    common = dict(namespace=arg['namespace'], output='screen', emulate_tty=True,
                  additional_env=env,
                  arguments=['--ros-args', '--log-level', arg['log_level']])
    out = [Node(package='oxygen_ros', executable='oxygen_node', name='oxygen_node',
                parameters=params, **common)]
    if arg['sim'].lower() == 'true':
        out.append(Node(package='oxygen_ros', executable='oxygen_sim_robot',
                        name='oxygen_sim_robot', parameters=[robot_file, overrides], **common))
    return out


def generate_launch_description():
    return LaunchDescription([
        DeclareLaunchArgument('robot', default_value='aloha',
                              description='aloha, droid or sim: picks config/<robot>.yaml'),
        DeclareLaunchArgument('params_file', default_value='',
                              description='robot parameters file instead of config/<robot>.yaml'),
        DeclareLaunchArgument('checkpoint', default_value='',
                              description="checkpoint directory; '' keeps the files' value"),
        DeclareLaunchArgument('device', default_value='',
                              description="cpu or cuda; '' keeps the files' value"),
        DeclareLaunchArgument('autostart', default_value='',
                              description="true: configure and activate at once; false: wait "
                              "for lifecycle transitions; '' keeps the files' value"),
        DeclareLaunchArgument('namespace', default_value='', description='node namespace'),
        DeclareLaunchArgument('use_sim_time', default_value='false',
                              description='follow /clock'),
        DeclareLaunchArgument('log_level', default_value='info',
                              description='debug, info, warn, error'),
        DeclareLaunchArgument('sim', default_value='false',
                              description='also start oxygen_sim_robot on the same topics'),
        OpaqueFunction(function=nodes),
    ])
