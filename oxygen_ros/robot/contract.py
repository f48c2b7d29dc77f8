"""What oxygen_node may be told and how a robot fits the model, without ROS.

The parameter table (PARAMS, GROUP_PARAMS) lists every parameter with its type, range and
whether it may change while the node runs. Config is built from plain values (what ROS
parameters hold) and checks that cameras, joints and output groups fit together; the node
then checks it against the engine's slots and dims. Every mistake is a StartError with one
line that names the parameter.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from oxygen_ros.robot import safe_yaml
from oxygen_ros.robot.frames import MAX_BYTES, MAX_PIXELS, Assembler
from oxygen_ros.robot.limits import JointLimits, parse_limits
from oxygen_ros.robot.profiles import JointMap, make_profile
from oxygen_ros.robot.safe_yaml import shown

QOS_CHOICES = ('sensor_data', 'reliable', 'best_effort')


class StartError(Exception):
    """A bad parameter or a missing model file: said in one line, exit code 1."""


@dataclass(frozen=True)
class Param:
    name: str
    default: object  # None: no default; the empty list of `kind`
    description: str
    kind: str = ''  # 'str' / 'int' / 'float' / 'bool' / 'str[]' / 'int[]'; '' = from default
    low: float | None = None  # smallest value allowed
    above: bool = False  # low itself is not allowed (> low)
    high: float | None = None
    choices: tuple = ()
    live: bool = False  # may be set while the node runs (ros2 param set)

    @property
    def type(self) -> str:
        return self.kind or {str: 'str', bool: 'bool', int: 'int', float: 'float',
                             list: 'str[]'}[type(self.default)]

    def range_text(self) -> str:
        parts = []
        if self.low is not None:
            parts.append(f'{">" if self.above else ">="} {self.low:g}')
        if self.high is not None:
            parts.append(f'<= {self.high:g}')
        if self.choices:
            parts.append('one of ' + ', '.join(repr(c) if c == '' else str(c)
                                               for c in self.choices))
        return ' and '.join(parts)


# Every parameter the node reads, in one place. Output groups add
# outputs.<group>.{topic,joints,indices} for each name in output_groups, and joint limits
# joint_limits.<group>.<joint>.{lower,upper,velocity,acceleration,jerk} (LIMIT_PARAM) for
# each joint limited.
PARAMS = (
    # lifecycle and safety
    Param('autostart', False, 'configure and activate at start instead of waiting for '
          'lifecycle transitions'),
    Param('allow_random_weights', False, "let a robot profile other than 'identity' activate "
          "without a checkpoint (random weights: for timing and simulation only)"),
    Param('command', True, "false: shadow mode. The node runs as when commanding but sends "
          "its trajectories to ~/shadow/<group> (a fleet's robot: ~/<robot>/shadow/<group>) "
          "instead of the controllers, leaves them to another commander (an operator's "
          "teleop) and reports in diagnostics how far its predictions are from the measured "
          "motion. Setting it true is refused while another node commands the robot or a "
          "joint's mean error over the last 5 s is above shadow_margin", live=True),
    Param('shadow_margin', 0.1, "largest mean |predicted - measured| of any joint over the last "
          "5 s (rad, or the joint's unit) with which shadow mode may turn to commanding",
          low=0.0, above=True, high=10.0, live=True),
    Param('max_command_horizon', 0.5, 's; no published trajectory point lies further ahead; '
          '10 s holds a 50-action chunk at 5 Hz', low=0.0, above=True, high=10.0, live=True),
    Param('play_steps', 0, 'play only the first n actions of each chunk, then hold unless a '
          'newer chunk arrived; 0 = all', low=0, live=True),
    Param('replan_after', 0, "start the next frame only once n actions of the chunk being "
          "played are out, while the robot plays on (openpi's open_loop_horizon, LeRobot's "
          "n_action_steps: for a policy trained to act on whole chunks rather than re-plan at "
          'every frame); 0 = a frame whenever new inputs come', low=0, live=True),
    Param('open_loop_control', False, "the robot's trajectory controllers start each new "
          "trajectory from their last command, not from the measured state (JTC's "
          'open_loop_control, as they are configured): the speed limits then judge each motion '
          'from the setpoint; false = from where the arm is (Jazzy\'s default)'),
    Param('max_future_stamp', 0.05, 's; inputs stamped further ahead of the node clock are '
          'rejected; a second ahead is clocks out of sync, not latency', low=0.0, high=1.0),
    Param('commander_check', 3.0, 's; how long the node listens on its trajectory topics for '
          'another commander before activating (when another node publishes on them) and '
          'before commanding again after its inputs were stale this long (a healed network '
          'partition); longer than DDS takes to rediscover a host', low=0.0, high=60.0),
    Param('limit_hold_margin', 0.1, 'fraction of a joint\'s range (joint_limits): a target or '
          'measured position beyond a position limit by more than this holds the robot '
          'instead of being clamped; 1 is a whole range past the limit, 1000 clamps always',
          low=0.0, high=1000.0),
    Param('glitch_speed_factor', 1.5, "a joint reading that moved faster than this many times "
          "the joint's speed limit (joint_limits) since the last one is a glitch and dropped; "
          'a simulated arm in contact, or fingers faster than the command limit, need more',
          low=1.0, high=1000.0),
    Param('publish_predicted', False, '~/predicted_trajectory: the whole chunk of each frame'),
    # model and engine
    Param('model', '', "model config ('tiny', 'small', 'pi05' or a YAML path); with a "
          "checkpoint it sets the transformer dims, checked against the tensors; '' = the "
          "checkpoint's config.json ('small' for random weights)"),
    Param('checkpoint', '', "LeRobot pi05 or openpi directory, or a safetensors file; '' = "
          "random weights"),
    Param('normalize', True, "false: run a checkpoint without normalisation stats on purpose "
          "(otherwise missing stats are a start-up error)"),
    Param('conventions', '', "image, normalisation and step-time conventions: 'openpi' or "
          "'lerobot'; '' = what the checkpoint directory is",
          choices=('', 'openpi', 'lerobot')),
    Param('asset_id', '', "openpi: which assets/<asset_id>/norm_stats.json; '' = the only one"),
    Param('tokenizer', '', "SentencePiece model of the checkpoint's vocabulary; '' = the "
          "checkpoint directory's tokenizer.model or paligemma_tokenizer.model, else the "
          "built-in tokenizer (random weights, or a checkpoint of its 512-entry vocabulary)"),
    Param('device', 'cpu', "'cpu' or 'cuda'"),
    Param('threads', 1, 'torch threads; keep below the core count so control keeps time',
          low=0),
    Param('denoise_steps', 0, "flow-matching steps per action chunk; 0 = the checkpoint's "
          "(LeRobot's num_inference_steps), else 10", low=0),
    Param('mode', 'oxygen', "how a frame's language runs beside its actions: 'oxygen' (one "
          "shared prefill, narration decoded in one cross-frame batch), 'shared_kv' (one prefill, "
          "the frame's language decoded to the end within the frame) or 'isolated' (as "
          "shared_kv, with a second prefill for language): the paper's baselines, to measure",
          choices=('oxygen', 'shared_kv', 'isolated')),
    Param('decode_k', 5, 'narration decode steps per frame; 0 = fit the frame budget', low=0,
          live=True),
    Param('frame_budget_ms', 0.0, 'time per frame (narration decoding fills what the actions '
          'leave); 0 = half the chunk duration, so the next chunk is ready while this one '
          'still plays; 10 s is the longest chunk (max_command_horizon)', low=0.0,
          high=10000.0),
    Param('max_requests', 8, 'language requests (narration and ~/ask questions) decoded at '
          'once (KV cache rows)', low=1),
    Param('max_new_tokens', 30, 'tokens per narration request; live changes may only lower '
          'it below the value the KV cache was sized for at configure', low=1, live=True),
    Param('max_question_tokens', 48, "KV columns each row keeps for a ~/ask question's own "
          'tokens (the built-in tokenizer takes 23 for "is the cup in the gripper?" with its '
          'Question/Answer format); 0 = no questions', low=0),
    Param('max_open_questions', 16, '~/ask goals open at once (per robot in a fleet); one '
          'more is refused with the reason', low=1, high=1024),
    Param('question_timeout', 5.0, 's; a ~/ask question still waiting for its frame this '
          'long ends with reason timeout (the robot\'s inputs are stale or missing)', low=0.0,
          above=True, high=3600.0),
    Param('admission', 'drop_oldest', 'when all slots are busy',
          choices=('drop_oldest', 'reject_newest', 'wait')),
    Param('temperature', 0.0, 'narration sampling temperature; 0 = greedy', low=0.0,
          live=True),
    Param('seed', 0, 'random seed (weights when no checkpoint, noise, sampling)', low=0),
    Param('frame_noise', False, "each frame's flow-matching noise from (seed, robot, the "
          "frame's stamp) instead of one random stream: a recording of the robot's inputs "
          "replayed (oxygen-replay) gives the same chunk for the same frame"),
    Param('prompt_format', 'pi05', "'pi05' (task + state) or 'subtask'",
          choices=('pi05', 'subtask')),
    Param('compile', False, 'torch.compile the decode and denoise steps (for CUDA; slow start)'),
    Param('graphs', False, 'static-shape denoise and decode, captured as CUDA graphs at '
          'configure on CUDA (an alternative to compile)'),
    Param('rtc', False, 'real-time chunking: each chunk is sampled to continue the one being '
          'executed, so chunk switches do not jump'),
    Param('rtc_beta', 5.0, 'real-time chunking: largest guidance weight', low=0.0),
    Param('rtc_delay', 0, 'real-time chunking: actions executed before a new chunk is out; '
          '0 = measured (the slowest of the last frames, rounded up)', low=0),
    # robot
    Param('robot', 'identity', 'robot profile', choices=('identity', 'aloha', 'droid')),
    Param('profile_options', '', 'YAML mapping of profile options, e.g. "{delta: true}"'),
    Param('cameras', None, 'camera names, e.g. [cam_high, cam_left_wrist]', 'str[]'),
    Param('camera_topics', None, 'image topic per camera (relative); default <camera>/image_raw',
          'str[]'),
    Param('camera_slots', None, 'model image slot per camera, e.g. base_0_rgb', 'str[]'),
    Param('camera_transports', None, "per camera 'raw' (sensor_msgs/Image on its topic) or "
          "'compressed' (sensor_msgs/CompressedImage on <topic>/compressed, as image_transport "
          "publishes it); [] = a topic ending in /compressed is compressed, the others raw",
          'str[]', choices=('raw', 'compressed')),
    Param('optional_cameras', None, 'cameras whose slot is masked instead of holding the robot '
          'when they are missing or stale', 'str[]'),
    Param('image_qos', 'sensor_data', 'image subscription QoS', choices=QOS_CHOICES),
    Param('max_image_pixels', MAX_PIXELS, 'largest camera image, width x height, raw or as '
          "a compressed image's header says (checked before decoding); a bigger one is "
          'dropped', low=1, high=100_000_000),
    Param('max_image_bytes', MAX_BYTES, 'largest camera image in bytes: a raw image\'s data, '
          'a compressed payload, and what its header says it decodes to; a bigger one is '
          'dropped', low=1, high=1_000_000_000),
    Param('joint_topics', ['joint_states'], 'sensor_msgs/JointState topics (relative)'),
    Param('joint_sources', None, 'a name per joint topic, used in `joints` as source/joint; '
          'may be left out with one topic', 'str[]'),
    Param('joints', None, 'state joints in order, as source/joint (or joint with one topic)',
          'str[]'),
    Param('joint_qos', 'sensor_data', 'joint state subscription QoS', choices=QOS_CHOICES),
    Param('output_groups', None, 'trajectory outputs, e.g. [left_arm, left_gripper]', 'str[]'),
    Param('prompt', 'pick up the object', 'task prompt; ~/prompt changes it too', live=True),
    Param('max_prompt_chars', 500, 'longest prompt accepted', low=1, live=True),
    # timing
    Param('control_rate_hz', 70.0, 'trajectory publish rate; 1000 Hz is ros2_control\'s '
          'fastest usual update rate', low=0.0, above=True, high=1000.0),
    Param('action_rate_hz', 0.0, 'rate the model was trained at: action i is for frame time + '
          'i / action_rate_hz; 0 = control_rate_hz; pi0.5\'s robots recorded at 15 to 50 Hz',
          low=0.0, high=1000.0),
    Param('max_input_age', 0.5, 's; older inputs (cameras, and each joint) are stale and the '
          'robot holds; an arm moves far in 10 s', low=0.0, above=True, high=10.0),
    Param('max_skew', 0.1, 's; the most the inputs of one frame may be apart; 10 s as '
          'max_input_age', low=0.0, high=10.0),
    Param('narration_every_n_frames', 10, 'start a narration request every n frames; 0 = only '
          'on demand (~/narrate)', low=0, live=True),
    Param('report_period', 5.0, 's; the same problem is logged at most once per period; '
          '3600 is once an hour', low=0.0, above=True, high=3600.0, live=True),
    Param('diagnostics_rate_hz', 1.0, '/diagnostics publish rate; monitors read it at a few Hz',
          low=0.0, above=True, high=100.0),
    # a fleet
    Param('robots', None, 'robot names: one node serves them all from one engine, each with '
          'its own <robot>.* parameters (see FLEET_PARAMS); [] = the node\'s one robot, '
          'from the parameters above', 'str[]'),
)

GROUP_PARAMS = (
    Param('topic', '', 'trajectory topic (relative), e.g. arm_controller/joint_trajectory'),
    Param('joints', None, 'joint names the controller expects', 'str[]'),
    Param('indices', None, 'action vector index of each joint', 'int[]', low=0),
)

# joint_limits.<group>.<joint>.<key>: declared for each one given (a params file's nested
# joint_limits mapping), checked by parse_limits.
LIMIT_PARAM = Param('joint_limits.<group>.<joint>.<lower|upper|velocity|acceleration|jerk>',
                    None, 'position limits (rad or m), largest speed (per s), acceleration '
                    '(per s^2) and jerk (per s^3) of a commanded joint',
                    'float')

BY_NAME = {p.name: p for p in PARAMS}

# A robot of a fleet: <robot>.namespace, <robot>.robot_file, and any parameter of ROBOT_KEYS
# (and its outputs.* and joint_limits.*) as <robot>.<name>, over the robot file's values,
# over the node's own.
FLEET_PARAMS = (
    Param('namespace', '', "prefix of the robot's relative topics; '' = the robot's name"),
    Param('robot_file', '', "a params file (as config/sim.yaml) with the robot's parameters; "
          "'' = none"),
)
FLEET_BY_NAME = {p.name: p for p in FLEET_PARAMS}
ROBOT_KEYS = ('command', 'shadow_margin', 'max_command_horizon', 'play_steps',
              'replan_after', 'open_loop_control',
              'max_future_stamp', 'limit_hold_margin', 'glitch_speed_factor',
              'publish_predicted', 'robot', 'profile_options', 'cameras', 'camera_topics',
              'camera_slots', 'camera_transports', 'optional_cameras', 'image_qos',
              'max_image_pixels', 'max_image_bytes',
              'joint_topics', 'joint_sources', 'joints', 'joint_qos', 'output_groups', 'prompt',
              'max_prompt_chars', 'control_rate_hz', 'action_rate_hz', 'max_input_age', 'max_skew',
              'narration_every_n_frames')

ENGINE_KEYS = ('model', 'checkpoint', 'normalize', 'conventions', 'asset_id', 'tokenizer',
               'device', 'threads', 'denoise_steps', 'mode', 'decode_k', 'frame_budget_ms',
               'max_requests', 'max_new_tokens', 'admission', 'temperature', 'seed',
               'frame_noise',
               'prompt_format', 'compile', 'graphs', 'rtc', 'rtc_beta',
               'max_question_tokens')


def coerce(name: str, value, p: Param):
    """The value of parameter `name` in its declared type, or StartError saying why not."""
    kind = p.type
    if value is None:
        if kind.endswith('[]'):
            return list(p.default or [])
        return p.default
    ok = {
        'str': isinstance(value, str),
        'bool': isinstance(value, bool),
        'int': isinstance(value, int) and not isinstance(value, bool),
        'float': isinstance(value, (int, float)) and not isinstance(value, bool),
        'str[]': isinstance(value, (list, tuple)) and all(isinstance(x, str) for x in value),
        'int[]': isinstance(value, (list, tuple)) and all(
            isinstance(x, int) and not isinstance(x, bool) for x in value),
    }[kind]
    if not ok:
        raise StartError(f'parameter {name} must be {kind}, got {shown(value)}')
    if kind == 'float':
        try:
            value = float(value)
        except OverflowError:  # an int past float's range
            value = math.inf
        if not math.isfinite(value):
            raise StartError(f'parameter {name} must be finite, got {shown(value)}')
    items = list(value) if kind.endswith('[]') else [value]
    for x in items:
        bad = ((p.low is not None and (x < p.low or (p.above and x == p.low)))
               or (p.high is not None and x > p.high)
               or (p.choices and x not in p.choices))
        if bad:
            raise StartError(f'parameter {name} must be {p.range_text()}, got {shown(x)}')
    return list(value) if kind.endswith('[]') else value


def robot_key(name: str) -> bool:
    """Whether `name` (without the robot's prefix) is a robot's own parameter."""
    return (name in ROBOT_KEYS or name.startswith('outputs.') or is_limit(name)
            or name in ('namespace', 'robot_file'))


def flatten(tree: dict, prefix: str = '') -> dict:
    """A params file's nested mapping as ROS flattens it: {'a': {'b': 1}} -> {'a.b': 1}."""
    out = {}
    for k, v in tree.items():
        name = f'{prefix}{k}'
        if isinstance(v, dict):
            out.update(flatten(v, name + '.'))
        else:
            out[name] = v
    return out


def read_robot_file(robot: str, path: str) -> tuple[dict, list[str]]:
    """The robot parameters of a params file (its first node's ros__parameters), flat, and
    the node parameters it also sets, which a robot cannot (the model and engine are shared
    by the node's robots: the node's values stand). Other names (e.g. oxygen_sim_robot's in
    config/sim.yaml) are for other nodes and are left alone."""
    where = f'robot {robot}: robot_file {path}'
    try:
        doc = safe_yaml.read(path)
    except OSError as e:
        raise StartError(f'{where}: {e.strerror or e}') from None
    except ValueError as e:
        raise StartError(f'{where}: {e}') from None
    if not isinstance(doc, dict) or not doc:
        raise StartError(f'{where}: expected a params file (<node>: ros__parameters: ...)')
    block = next(iter(doc.values()))
    params = block.get('ros__parameters') if isinstance(block, dict) else None
    if not isinstance(params, dict):
        raise StartError(f'{where}: no ros__parameters mapping')
    values = flatten(params)
    own = {k: v for k, v in values.items() if robot_key(k) and k not in FLEET_BY_NAME}
    shared = sorted(k for k in values if k in BY_NAME and k not in own)
    return own, shared


def robot_config(robot: str, node_values: dict, file_values: dict, own: dict) -> Config:
    """One robot of a fleet: its own values over its robot file's over the node's."""
    if not re.fullmatch(r'[A-Za-z][A-Za-z0-9_]*', robot):
        raise StartError(f'robot name {shown(robot)} must be a plain identifier')
    given = {**file_values, **own}
    values = dict(node_values)
    # Output groups and joint limits come whole from one place, the robot's or the node's.
    for kind in ('outputs.', 'joint_limits'):
        if any(k.startswith(kind) for k in given):
            values = {k: v for k, v in values.items() if not k.startswith(kind)}
    values.update(given)
    values.pop('namespace', None)
    values.pop('robot_file', None)
    values['robots'] = []
    try:
        return Config.from_values(values)
    except StartError as e:
        raise StartError(f'robot {robot}: {e}') from None


def is_limit(name: str) -> bool:
    """Whether `name` is (meant as) a joint_limits parameter."""
    return name == 'joint_limits' or name.startswith('joint_limits.')


def prompt_problem(text: str, limit: int) -> str | None:
    if not text.strip():
        return 'empty prompt'
    if len(text) > limit:
        return f'prompt of {len(text)} characters is over the limit of {limit}'
    return None


def command_line_params(args, node_name: str) -> dict[str, object]:
    """The `-p name:=value` rules of a command line that apply to `node_name`, with their
    values read as ROS reads them (YAML). ROS drops a -p value whose type differs from a
    params file's value for the same name without a word, so the node checks these itself."""
    out = {}
    in_ros = False
    args = list(args or [])
    for i, a in enumerate(args):
        if a == '--ros-args':
            in_ros = True
        elif a == '--':
            in_ros = False
        elif in_ros and a in ('-p', '--param') and i + 1 < len(args):
            rule = args[i + 1]
            name, sep, text = rule.partition(':=')
            if not sep:
                continue
            node, colon, pname = name.rpartition(':')
            if colon and node not in (node_name, '*', '**') and node.lstrip('/') != node_name:
                continue
            try:
                out[pname] = safe_yaml.load(text)
            except ValueError:
                out[pname] = text
    return out


@dataclass
class Group:
    name: str
    topic: str
    joints: list[str]
    indices: list[int]


@dataclass
class Config:
    """Checked parameter values and the robot contract that follows from them."""

    p: dict
    groups: list[Group]
    profile: object
    cameras: dict[str, str]  # camera -> topic (a compressed camera's ends in /compressed)
    slots: dict[str, str]  # camera -> model image slot
    joint_topics: dict[str, str]  # source -> topic
    joint_map: JointMap
    wanted: dict[str, set[str]]  # source -> joint names read from it
    action_period: float
    transports: dict[str, str]  # camera -> 'raw' or 'compressed'
    # Per action index, where its measured position is read for a hold: (source, joint).
    hold_sources: dict[int, tuple[str, str]] = field(default_factory=dict)
    limits: JointLimits | None = None
    # max_new_tokens the engine's KV cache was sized for at configure (None before): a live
    # value may go back up to it, not past it.
    sized_tokens: int | None = None
    # From configure on: the most tokens a prompt takes in the model's prefix with this
    # robot's state (the engine's tokenizer and prompt format), and the prefix's room for
    # them (the model's max_token_len). The tokenizer cuts what does not fit: the state.
    prompt_tokens: Callable[[str], int] | None = None
    max_token_len: int = 0

    @classmethod
    def from_values(cls, values: dict) -> Config:
        """values: {name: value} for PARAMS, outputs.<group>.<key> for GROUP_PARAMS and
        joint_limits.<group>.<joint>.<key>; names left out take their defaults."""
        p = {q.name: coerce(q.name, values.get(q.name), q) for q in PARAMS}
        groups = []
        for g in p['output_groups']:
            if not re.fullmatch(r'[A-Za-z][A-Za-z0-9_]*', g):
                raise StartError(f'output group name {shown(g)} must be a plain identifier')
            q = {k.name: coerce(f'outputs.{g}.{k.name}', values.get(f'outputs.{g}.{k.name}'), k)
                 for k in GROUP_PARAMS}
            groups.append(Group(g, q['topic'], q['joints'], q['indices']))
        why = prompt_problem(p['prompt'], p['max_prompt_chars'])
        if why:
            raise StartError(f'parameter prompt: {why}')
        cfg = _contract(p, groups)
        try:
            given = parse_limits({k: v for k, v in values.items() if is_limit(k)}, groups)
        except ValueError as e:
            raise StartError(f'parameter {e}') from None
        if given:  # none given: no limits at all, and the start-up log says so
            cfg.limits = JointLimits(cfg.profile.action_dim, given, p['limit_hold_margin'])
        return cfg

    @property
    def output_names(self) -> dict[int, str]:
        """Action index -> '<group>/<joint>' of the joint it drives, group by group (ALOHA's
        two arms share joint names: the group tells them apart)."""
        return {i: f'{g.name}/{j}' for g in self.groups
                for j, i in zip(g.joints, g.indices, strict=True)}

    @property
    def random_weights(self) -> bool:
        return not self.p['checkpoint']

    def engine_settings(self) -> dict:
        d = {k: self.p[k] for k in ENGINE_KEYS}
        # The engine's default budget is the chunk duration (action_horizon /
        # control_rate_hz). A frame that long ends as its chunk runs out, and the robot holds
        # until the next one: half of it leaves the other half for the latency of the next.
        d['control_rate_hz'] = 2.0 / self.action_period
        return d

    def check_engine(self, slots, action_dim: int, state_dim: int | None = None,
                     exact_state: bool = False) -> None:
        """The robot file against what the model (its checkpoint) states: camera slots by
        name, the action dims, and the state dims (exactly, for LeRobot checkpoints)."""
        model = self.p['checkpoint'] or f'model {self.p["model"] or "small"!r}'
        unknown = sorted(set(self.slots.values()) - set(slots))
        if unknown:
            raise StartError(f'camera_slots {unknown} are not slots of {model}: '
                             f'{list(slots)}')
        robot, prof = self.p['robot'], self.profile
        if prof.action_dim > action_dim:
            raise StartError(f'the {robot} profile needs {prof.action_dim}-d actions but '
                             f'{model} has {action_dim}')
        if state_dim is not None and (prof.state_dim > state_dim
                                      or (exact_state and prof.state_dim != state_dim)):
            need = 'exactly' if exact_state else 'at most'
            raise StartError(f'the {robot} profile gives a {prof.state_dim}-d state but '
                             f'{model} takes {need} {state_dim}')

    def check_live(self, name: str, value) -> object:
        """The value a running node may take for `name`, or StartError saying why not."""
        p = BY_NAME.get(name)
        if p is None or not p.live:
            raise StartError(f'{name} cannot change while the node runs; set it before '
                             'configure (restart the node)')
        value = coerce(name, value, p)
        if name == 'max_new_tokens' and self.sized_tokens is not None \
                and value > self.sized_tokens:
            raise StartError(f'max_new_tokens may not exceed {self.sized_tokens} while '
                             f'configured: the KV cache was sized for {self.sized_tokens}')
        if name == 'decode_k' and (value == 0) != (self.p['decode_k'] == 0):
            raise StartError('decode_k cannot switch between adaptive (0) and fixed while '
                             'running')
        if name == 'max_command_horizon':
            _check_horizon(value, self.action_period)
        if name == 'prompt':
            why = self.check_prompt(value)
            if why:
                raise StartError(f'prompt: {why}')
        return value

    def check_prompt(self, text: str) -> str | None:
        """Why `text` cannot be this robot's task prompt, or None: empty, too many characters,
        or (once configured) too many tokens for the model's prefix."""
        why = prompt_problem(text, self.p['max_prompt_chars'])
        if why or self.prompt_tokens is None:
            return why
        n = self.prompt_tokens(text)
        if n <= self.max_token_len:
            return None
        if self.p['prompt_format'] == 'pi05':
            return (f'prompt of {n} tokens with the {self.profile.state_dim}-d state (each '
                    f'value at its longest) is over the model\'s max_token_len of '
                    f'{self.max_token_len}: the state would be cut off')
        return (f'prompt of {n} tokens is over the model\'s max_token_len of '
                f'{self.max_token_len}: it would be cut off')

    def assembler(self) -> Assembler:
        cams, optional = self.p['cameras'], self.p['optional_cameras']
        return Assembler(
            required=[c for c in cams if c not in optional]
            + [f'joints:{s}' for s in self.joint_topics],
            optional=optional,
            # Held samples may lie ahead of the clock by max_input_age (the Assembler's
            # default), not max_future_stamp, which judges a stamp as it arrives.
            max_input_age=self.p['max_input_age'], max_skew=self.p['max_skew'],
            # One frame per image of the main camera: joint states come faster and would
            # otherwise rerun the model on the same images.
            trigger=[next(c for c in cams if c not in optional)])


def _check_horizon(horizon: float, period: float) -> None:
    if horizon < period:
        raise StartError(f'max_command_horizon {horizon:g} s is shorter than one action period '
                         f'({period:g} s): no action could ever be sent')


def _contract(p: dict, groups: list[Group]) -> Config:
    try:
        options = safe_yaml.load(p['profile_options']) if p['profile_options'] else {}
    except ValueError as e:
        raise StartError(f'profile_options: {e}') from None
    if not isinstance(options, dict):
        raise StartError(f'profile_options must be a YAML mapping, got {shown(options)}')
    if p['robot'] == 'identity':
        options.setdefault('dim', len(p['joints']))
    try:
        profile = make_profile(p['robot'], **options)
    except (TypeError, ValueError) as e:
        raise StartError(f'robot profile {p["robot"]!r}: {e}') from None

    cams = p['cameras']
    if not cams:
        raise StartError('cameras is empty: name at least one camera')
    if len(set(cams)) != len(cams):
        raise StartError(f'cameras lists a name twice: {cams}')
    topics = p['camera_topics'] or [f'{c}/image_raw' for c in cams]
    if len(topics) != len(cams) or len(p['camera_slots']) != len(cams):
        raise StartError(f'cameras ({len(cams)}), camera_topics ({len(topics)}) and '
                         f'camera_slots ({len(p["camera_slots"])}) must have equal lengths')
    if len(set(p['camera_slots'])) != len(cams):
        raise StartError(f'camera_slots lists a slot twice: {p["camera_slots"]}')
    topics, transports = _transports(cams, topics, p['camera_transports'])
    unknown = sorted(set(p['optional_cameras']) - set(cams))
    if unknown:
        raise StartError(f'optional_cameras names unknown cameras {unknown}; cameras: {cams}')
    if set(p['optional_cameras']) == set(cams):
        raise StartError('every camera is optional: at least one must be required')

    jt = p['joint_topics']
    if not jt:
        raise StartError('joint_topics is empty')
    sources = p['joint_sources'] or ([''] if len(jt) == 1 else [])
    if len(sources) != len(jt):
        raise StartError(f'joint_sources must name each of the {len(jt)} joint_topics, '
                         f'got {sources}')
    joint_topics = dict(zip(sources, jt, strict=True))
    labels = []
    for label in p['joints']:
        if len(sources) == 1 and not label.startswith(sources[0] + '/'):
            src, name = sources[0], label
        else:
            src, _, name = label.partition('/')
        if src not in joint_topics:
            raise StartError(f'joint {label!r}: no joint source {src!r}; sources: {sources}')
        labels.append((src, name))
    try:
        joint_map = JointMap(labels)
    except ValueError as e:
        raise StartError(f'joints: {e}') from None
    if len(joint_map) != profile.state_dim:
        raise StartError(f'{len(joint_map)} joints listed but the {p["robot"]} profile '
                         f'takes a {profile.state_dim}-d state')
    wanted = {s: {n for src, n in labels if src == s} for s in sources}

    if not groups:
        raise StartError('output_groups is empty: name at least one trajectory output')
    hold_sources = {}
    for k, g in enumerate(groups):
        if not g.topic:
            raise StartError(f'outputs.{g.name}.topic is empty')
        if not g.joints or len(g.joints) != len(g.indices):
            raise StartError(f'outputs.{g.name}: joints ({len(g.joints)}) and indices '
                             f'({len(g.indices)}) must be non-empty and of equal length')
        bad = [i for i in g.indices if not 0 <= i < profile.action_dim]
        if bad:
            raise StartError(f'outputs.{g.name}.indices {bad} outside the '
                             f'{profile.action_dim}-d action of {p["robot"]}')
        for key, items in (('indices', g.indices), ('joints', g.joints)):
            twice = ', '.join(str(x) for x in sorted({x for x in items if items.count(x) > 1}))
            if twice:
                raise StartError(f'outputs.{g.name}.{key} lists {twice} twice')
        for h in groups[:k]:
            # A copied indices list would have two controllers follow one action.
            both = [i for i in g.indices if i in h.indices]
            if both:
                raise StartError(f'action index {both[0]} is in outputs.{h.name}.indices and '
                                 f'outputs.{g.name}.indices: each action drives one joint')
            if h.topic.rstrip('/') == g.topic.rstrip('/'):
                raise StartError(f'outputs.{h.name}.topic {h.topic!r} and outputs.{g.name}.topic '
                                 f'{g.topic!r} are one topic: a controller follows one '
                                 'trajectory at a time')
        for i, joint in zip(g.indices, g.joints, strict=True):
            # Action i drives state joint i in the built-in profiles, so the controller's
            # joint is read from the same source (e.g. ALOHA's `gripper` from follower_left).
            src = labels[i][0] if i < len(labels) else sources[0]
            hold_sources[i] = (src, joint)
    period = 1.0 / (p['action_rate_hz'] or p['control_rate_hz'])
    _check_horizon(p['max_command_horizon'], period)
    return Config(p, groups, profile, dict(zip(cams, topics, strict=True)),
                  dict(zip(cams, p['camera_slots'], strict=True)), joint_topics, joint_map,
                  wanted, period, transports, hold_sources)


def compressed_topic(topic: str) -> bool:
    """Whether `topic` is image_transport's compressed topic of an image."""
    return topic.rstrip('/').split('/')[-1] == 'compressed'


def _transports(cams, topics, given):
    """The topic each camera is read from and its transport. A compressed camera whose
    topic is the raw one reads <topic>/compressed, as image_transport names it."""
    if given and len(given) != len(cams):
        raise StartError(f'camera_transports names {len(given)} transports for '
                         f'{len(cams)} cameras: one per camera, or [] for all from the topics')
    out_topics, transports = [], {}
    for i, (cam, topic) in enumerate(zip(cams, topics, strict=True)):
        by_topic = compressed_topic(topic)
        kind = given[i] if given else ('compressed' if by_topic else 'raw')
        if kind == 'raw' and by_topic:
            raise StartError(f'camera_transports says raw for camera {cam}, but its topic '
                             f'{topic!r} ends in /compressed (sensor_msgs/CompressedImage): '
                             'say compressed, or give the raw image topic')
        if kind == 'compressed':
            from oxygen_ros.robot.images import unavailable

            why = unavailable()
            if why:
                raise StartError(f'camera {cam} is compressed, but {why}')
            if not by_topic:
                topic = topic.rstrip('/') + '/compressed'
        out_topics.append(topic)
        transports[cam] = kind
    return out_topics, transports
