"""Start one oxygen_node for several robots (and, with sim:=true, a simulated robot each).

    ros2 launch oxygen_ros fleet.launch.py robots:=left,right robot:=sim sim:=true

One node, one engine, one model in memory: `robots` names the robots, each in the
namespace of its name (its topics are <robot>/..., its ~/ask is /oxygen_node/<robot>/ask),
and every robot takes config/<robot>.yaml (or params_file) as its robot file. The node's
parameters come from config/pi05.yaml then that file, as in pi05.launch.py; checkpoint,
device and autostart override both when given. With sim:=true one oxygen_sim_robot per
robot runs in the robot's namespace on the same robot file. Robots with files of their own:
a params file with `robots` and `<robot>.robot_file` given to pi05.launch.py's params_file
(docs/robots.md, "A fleet").

Past one GPU host, a fleet file names each server's robots (oxygen_ros/ros/fleet_file.py):

    ros2 launch oxygen_ros fleet.launch.py fleet_file:=fleet.yaml server:=gpu_a
    ros2 launch oxygen_ros fleet.launch.py fleet_file:=fleet.yaml server:=gpu_a standby:=true

The first runs oxygen_node_gpu_a for gpu_a's robots (robots:= is then not used); the second
a standby for them, oxygen_node_gpu_a_standby, which stays unconfigured until configured and
activated (docs/robots.md, "Robots and servers on different hosts").
"""
# ruff would file `launch` under this repository's launch/ folder and sort it last.
import os  # noqa: I001
import re

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import OpaqueFunction
from launch_ros.actions import Node

from oxygen_ros.ros import fleet_file, launch_args


def robot_names(text: str) -> list[str]:
    names = [n for n in re.split(r'[,\s]+', text.strip()) if n]
    bad = [n for n in names if not re.fullmatch(r'[A-Za-z][A-Za-z0-9_]*', n)]
    if not names or bad or len(set(names)) != len(names):
        raise ValueError(f'robots:={text!r} must list distinct plain names, e.g. left,right')
    return names


def nodes(context):
    arg = launch_args.values(context, 'robots', 'robot', 'sim', 'fleet_file', 'server',
                             'standby')
    name = 'oxygen_node'
    standby = arg['standby'].lower() == 'true'
    if arg['fleet_file'] or arg['server'] or standby:
        if not (arg['fleet_file'] and arg['server']):
            raise ValueError('fleet_file:= and server:= go together (standby:= needs both)')
        robots = fleet_file.robots_of(arg['fleet_file'], arg['server'])
        name = fleet_file.node_name(arg['server'], standby)
        if standby:
            if arg['autostart'] == 'true':
                raise ValueError('standby:=true waits for its lifecycle transitions; '
                                 'autostart:=true would command the robots at once')
            arg['autostart'] = 'false'
    else:
        robots = robot_names(arg['robots'])
    config = os.path.join(get_package_share_directory('oxygen_ros'), 'config')
    robot_file = arg['params_file'] or os.path.join(config, f'{arg["robot"]}.yaml')
    overrides = launch_args.overrides(arg)
    fleet = dict(overrides, robots=robots)
    for r in robots:
        fleet[f'{r}.robot_file'] = robot_file
    common = launch_args.process(arg, config)
    out = [Node(package='oxygen_ros', executable='oxygen_node', name=name,
                parameters=[os.path.join(config, 'pi05.yaml'), robot_file, fleet], **common)]
    if arg['sim'].lower() == 'true':
        out += [Node(package='oxygen_ros', executable='oxygen_sim_robot',
                     name='oxygen_sim_robot', namespace=r,
                     parameters=[robot_file, overrides], **common) for r in robots]
    return out


def generate_launch_description():
    return LaunchDescription([
        *launch_args.declare(
            ('robots', 'left,right', 'robot names, comma separated; each one a namespace'),
            ('robot', 'sim', "aloha, droid or sim: config/<robot>.yaml is every robot's robot "
             'file'),
            ('sim', 'false', 'also start one oxygen_sim_robot per robot, in its namespace'),
            ('fleet_file', '', "servers and their robots (YAML); with server:=, that server's "
             'robots instead of robots:='),
            ('server', '', 'the fleet file server this node is: oxygen_node_<server>'),
            ('standby', 'false', "true: oxygen_node_<server>_standby for the server's robots, "
             'unconfigured until configured and activated')),
        OpaqueFunction(function=nodes),
    ])
