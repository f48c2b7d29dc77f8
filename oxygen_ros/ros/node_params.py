"""The node's parameters: declared with their descriptors and ranges, read, and checked.

The table itself is robot/params.py (no ROS); this declares it on an rclpy node, with the
command line checked on its own (ROS drops a -p value whose type differs from a params
file's), each output group's and joint limit's parameters, and, with `robots`, each robot's
<robot>.* parameters over its robot file's over the node's.
"""

from __future__ import annotations

from rcl_interfaces.msg import FloatingPointRange, IntegerRange, ParameterDescriptor

from oxygen_ros.robot.contract import Config, robot_config
from oxygen_ros.robot.params import (
    BY_NAME,
    FLEET_BY_NAME,
    GROUP_PARAMS,
    LIMIT_PARAM,
    PARAMS,
    StartError,
    coerce,
    command_line_params,
    identifier,
    is_limit,
    read_robot_file,
    robot_key,
)


def declare(node, name: str, p, default=None):
    from rclpy.exceptions import ParameterUninitializedException

    # dynamic_typing: a YAML `70` for a float parameter is fine; types are checked by
    # params.coerce with a message that names the parameter.
    desc = ParameterDescriptor(description=p.description + range_note(p),
                               dynamic_typing=True, read_only=not p.live)
    high = p.high
    if p.type in ('int', 'int[]') and p.low is not None:
        desc.integer_range = [IntegerRange(from_value=int(p.low), to_value=int(
            2**31 - 1 if high is None else high))]
    elif p.type == 'float' and p.low is not None:
        desc.floating_point_range = [FloatingPointRange(from_value=float(p.low), to_value=(
            1e300 if high is None else float(high)))]
    # Our message, naming the rule broken, before rclpy's range check on the override.
    override = node._parameter_overrides.get(name)
    if override is not None:
        coerce(name, override.value, p)
    try:
        node.declare_parameter(name, p.default if default is None else default, desc)
        return node.get_parameter(name).value
    except ParameterUninitializedException:
        return None
    except Exception as e:  # rclpy's own range or type errors on an override
        raise StartError(f'parameter {name}: {e}') from None

def read(node, argv) -> Config:
    """Every parameter of the node declared and checked; with `robots`, node.fleet gets each
    robot's Config and namespace, and the first robot's Config is returned."""
    values = {p.name: declare(node, p.name, p) for p in PARAMS}
    groups = coerce('output_groups', values['output_groups'], BY_NAME['output_groups'])
    for g in groups:
        if not identifier(g):
            continue  # not a parameter name: Config says so below
        for p in GROUP_PARAMS:
            values[f'outputs.{g}.{p.name}'] = declare(node, f'outputs.{g}.{p.name}', p)
    # Joint limits are declared as given (a params file's joint_limits mapping arrives
    # flattened); Config says what is wrong with them.
    limits = sorted(n for n in node._parameter_overrides if is_limit(n))
    for name in limits:
        values[name] = declare(node, name, LIMIT_PARAM)
    # ROS drops a command-line -p value whose type differs from a params file's, so the
    # command line is checked on its own too.
    table = {p.name: p for p in PARAMS}
    table.update({f'outputs.{g}.{p.name}': p for g in groups for p in GROUP_PARAMS})
    table.update({name: LIMIT_PARAM for name in limits})
    for name, value in command_line_params(argv, node.get_name()).items():
        if name in table:
            coerce(name, value, table[name])
    robots = coerce('robots', values['robots'], BY_NAME['robots'])
    if not robots:
        return Config.from_values(values)
    if len(set(robots)) != len(robots):
        raise StartError(f'robots lists a name twice: {robots}')
    for r in robots:
        node.fleet[r] = read_robot(node, r, values)
    # The node's own settings (engine, lifecycle) with the first robot's contract.
    return node.fleet[robots[0]][0]

def read_robot(node, robot: str, values: dict) -> tuple[Config, str]:
    """A robot's <robot>.* parameters over its robot file's over the node's."""
    own = {}
    for full in sorted(n for n in node._parameter_overrides if n.startswith(robot + '.')):
        name = full[len(robot) + 1:]
        if not robot_key(name):
            raise StartError(f'robot {robot}: {name} is not a robot parameter (the '
                             'model and engine are the node\'s, shared by its robots)')
        if name.startswith('outputs.'):
            key = name.rpartition('.')[2]
            p = next((q for q in GROUP_PARAMS if q.name == key), None)
            if p is None:
                raise StartError(f'robot {robot}: unknown parameter {name}')
        elif is_limit(name):
            p = LIMIT_PARAM
        else:
            p = FLEET_BY_NAME.get(name) or BY_NAME[name]
        own[name] = declare(node, full, p)
    path = own.get('robot_file') or ''
    file_values, shared = read_robot_file(robot, path) if path else ({}, [])
    if shared:
        node.log.info(f'robot {robot}: {path} also sets {", ".join(shared)}: the '
                      "node's values stand (its robots share them)")
    cfg = robot_config(robot, values, file_values, own)
    if 'prompt' not in own:  # settable while running, as the node's prompt is
        declare(node, f'{robot}.prompt', BY_NAME['prompt'], cfg.p.prompt)
    return cfg, own.get('namespace') or robot


def range_note(p) -> str:
    text = p.range_text()
    return (f' ({text})' if text else '') + ('' if p.live else ' [read-only while running]')
