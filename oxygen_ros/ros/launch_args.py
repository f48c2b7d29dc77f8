"""What pi05.launch.py and fleet.launch.py share: the arguments that set up oxygen_node, the
parameter overrides they make, and the process settings of every node they start. Imported
by the launch files only (it needs launch and launch_ros)."""

import os

from launch.actions import DeclareLaunchArgument
from launch.substitutions import LaunchConfiguration

# name, default, description; both files declare these, each adds its own.
COMMON = [
    ('params_file', '', 'robot parameters file instead of config/<robot>.yaml'),
    ('checkpoint', '', "checkpoint directory; '' keeps the files' value"),
    ('tokenizer', '', "the checkpoint's SentencePiece tokenizer (pi0.5: "
     "paligemma_tokenizer.model); '' keeps the files' value"),
    ('device', '', "cpu or cuda; '' keeps the files' value"),
    ('autostart', '', "true: configure and activate at once; false: wait for lifecycle "
     "transitions; '' keeps the files' value"),
    ('command', '', "false: shadow mode (trajectories to ~/shadow/<group>, not the "
     "controllers); true: command; '' keeps the files' value"),
    ('use_sim_time', 'false', 'follow /clock'),
    ('log_level', 'info', 'debug, info, warn, error'),
]


def declare(*own):
    """DeclareLaunchArgument for each (name, default, description) of `own`, then COMMON."""
    return [DeclareLaunchArgument(n, default_value=d, description=why)
            for n, d, why in [*own, *COMMON]]


def values(context, *own) -> dict:
    """The given values of COMMON and of the names in `own`."""
    return {n: LaunchConfiguration(n).perform(context)
            for n in [*own, *(c[0] for c in COMMON)]}


def overrides(arg: dict) -> dict:
    """Parameters that override the files: sim time, and only what the command line gave."""
    out = {'use_sim_time': arg['use_sim_time'].lower() == 'true'}
    for name in ('checkpoint', 'tokenizer', 'device'):
        if arg[name]:
            out[name] = arg[name]
    for name in ('autostart', 'command'):
        if arg[name]:
            if arg[name] not in ('true', 'false'):
                raise ValueError(f'{name}:={arg[name]} must be true or false')
            out[name] = arg[name] == 'true'
    return out


def process(arg: dict, config: str) -> dict:
    """Node keyword arguments every started node gets: the log level, screen output and,
    unless FASTRTPS_DEFAULT_PROFILES_FILE is set already, config/fastdds.xml."""
    env = {}
    if not os.environ.get('FASTRTPS_DEFAULT_PROFILES_FILE'):
        env['FASTRTPS_DEFAULT_PROFILES_FILE'] = os.path.join(config, 'fastdds.xml')
    return dict(output='screen', emulate_tty=True, additional_env=env,
                arguments=['--ros-args', '--log-level', arg['log_level']])
