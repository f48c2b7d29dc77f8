"""What oxygen_node may be told, without ROS: every parameter with its type, range and
whether it may change while the node runs (PARAMS, GROUP_PARAMS, the joint limits, a fleet's),
and where values come from besides ROS's own parameters: a robot file, the command line's
-p rules. Every mistake is a StartError with one line that names the parameter.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from oxygen_ros.engine import PROMPT_FORMATS
from oxygen_ros.engine.admission import ADMISSION
from oxygen_ros.engine.scheduler import MODES
from oxygen_ros.model.processing import CONVENTIONS
from oxygen_ros.robot import safe_yaml
from oxygen_ros.robot.images import MAX_BYTES, MAX_PIXELS
from oxygen_ros.robot.safe_yaml import shown

QOS_CHOICES = ('sensor_data', 'reliable', 'best_effort')


# Robot, output group and server names: they become parameter names and topic namespaces.
NAME = re.compile(r'[A-Za-z][A-Za-z0-9_]*')


def identifier(name) -> bool:
    """Whether ``name`` is a plain identifier (a letter, then letters, digits, _)."""
    return isinstance(name, str) and NAME.fullmatch(name) is not None


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
          'every frame), or earlier when the chunk would run out before the next one comes: '
          'at the latest replan_lead_ms (p95 of the last 20 frame-to-chunk latencies, or the '
          'last one if longer, and a control period) before its end; 0 = a frame whenever new '
          'inputs come', low=0, live=True),
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
    Param('allow_unlimited', False, "let a real robot profile ('aloha', 'droid') start without "
          'joint_limits: its positions and speeds then go unbounded to the controllers; '
          'otherwise a robot file without them is a configure error'),
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
          choices=('', *CONVENTIONS)),
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
          choices=MODES),
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
          choices=ADMISSION),
    Param('temperature', 0.0, 'narration sampling temperature; 0 = greedy', low=0.0,
          live=True),
    Param('stop_at_eos', True, "a request ends at the tokenizer's end of text; false: every "
          'one decodes its whole budget (max_new_tokens) whatever it says, a fixed language '
          'load for measurements'),
    Param('seed', 0, 'random seed (weights when no checkpoint, noise, sampling)', low=0),
    Param('frame_noise', False, "each frame's flow-matching noise from (seed, robot, the "
          "frame's stamp) instead of one random stream: a recording of the robot's inputs "
          "replayed (oxygen-replay) gives the same chunk for the same frame"),
    Param('prompt_format', 'pi05', "'pi05' (task + state) or 'subtask'",
          choices=PROMPT_FORMATS),
    Param('compile', True, 'run the model compiled where that pays (float32 on a CPU): '
          'AOTInductor programs of its phases, built at configure the first time for these '
          'model dims (tens of seconds each on two cores) and loaded from compile_cache '
          'after that; on CUDA graphs is the fast path and this changes nothing'),
    Param('compile_cache', '', "directory of the compiled programs; '' = "
          '$OXYGEN_COMPILE_CACHE, else ~/.cache/oxygen_ros/compiled'),
    Param('graphs', False, 'static-shape denoise and decode, captured as CUDA graphs at '
          'configure on CUDA (on a CPU the same static calls run eagerly: for tests)'),
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
    # Bounded: a prompt is tokenized on the executor thread, and no model's prefix holds
    # 2000 characters (pi0.5's is 200 tokens).
    Param('max_prompt_chars', 500, 'longest prompt accepted', low=1, high=2000, live=True),
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
    Param('hold', 'reading', "where a hold keeps the group's joints: 'reading', where they "
          "are (an arm), or 'setpoint', where they were last commanded (a gripper closed on "
          'an object goes on squeezing it; at its reading it would open to the width of the '
          'object and drop it)', choices=('reading', 'setpoint')),
)


# joint_limits.<group>.<joint>.<key>: declared for each one given (a params file's nested
# joint_limits mapping), checked by parse_limits.
LIMIT_PARAM = Param('joint_limits.<group>.<joint>.<lower|upper|velocity|acceleration|jerk>',
                    None, 'position limits (rad or m), largest speed (per s), acceleration '
                    '(per s^2) and jerk (per s^3) of a commanded joint',
                    'float')


BY_NAME = {p.name: p for p in PARAMS}


class Values(dict):
    """Checked values of PARAMS, read by name as attributes (`cfg.p.control_rate_hz`): a
    misspelt name is an AttributeError where it is read, never a silent default. Dotted
    names (outputs.<group>.*, joint_limits.*) and names held in variables are read as keys."""

    __slots__ = ()

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f'no parameter {name!r}') from None

    def __setattr__(self, name: str, value) -> None:
        if name not in self:
            raise AttributeError(f'no parameter {name!r}')
        self[name] = value


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
              'max_future_stamp', 'limit_hold_margin', 'allow_unlimited', 'glitch_speed_factor',
              'publish_predicted', 'robot', 'profile_options', 'cameras', 'camera_topics',
              'camera_slots', 'camera_transports', 'optional_cameras', 'image_qos',
              'max_image_pixels', 'max_image_bytes',
              'joint_topics', 'joint_sources', 'joints', 'joint_qos', 'output_groups', 'prompt',
              'max_prompt_chars', 'control_rate_hz', 'action_rate_hz', 'max_input_age', 'max_skew',
              'narration_every_n_frames')


ENGINE_KEYS = ('model', 'checkpoint', 'normalize', 'conventions', 'asset_id', 'tokenizer',
               'device', 'threads', 'denoise_steps', 'mode', 'decode_k', 'frame_budget_ms',
               'max_requests', 'max_new_tokens', 'admission', 'temperature', 'stop_at_eos',
               'seed', 'frame_noise',
               'prompt_format', 'compile', 'compile_cache', 'graphs', 'rtc', 'rtc_beta',
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
