"""How a robot fits the model, without ROS.

Config is built from plain values (what ROS parameters hold, checked against the table in
params.py) and checks that cameras, joints and output groups fit together; the node then
checks it against the engine's slots and dims. Every mistake is a StartError with one line
that names the parameter.
"""


from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from oxygen_ros.robot import safe_yaml
from oxygen_ros.robot.frames import Assembler
from oxygen_ros.robot.limits import JointLimits, parse_limits
from oxygen_ros.robot.params import (
    BY_NAME,
    ENGINE_KEYS,
    GROUP_PARAMS,
    PARAMS,
    StartError,
    Values,
    coerce,
    identifier,
    is_limit,
    prompt_problem,
)
from oxygen_ros.robot.profiles import JointMap, make_profile
from oxygen_ros.robot.safe_yaml import shown


def robot_config(robot: str, node_values: dict, file_values: dict, own: dict) -> Config:
    """One robot of a fleet: its own values over its robot file's over the node's."""
    if not identifier(robot):
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


@dataclass
class Group:
    name: str
    topic: str
    joints: list[str]
    indices: list[int]
    hold: str = 'reading'  # or 'setpoint' (GROUP_PARAMS)


@dataclass
class Config:
    """Checked parameter values and the robot contract that follows from them."""

    p: Values
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
        p = Values({q.name: coerce(q.name, values.get(q.name), q) for q in PARAMS})
        groups = []
        for g in p.output_groups:
            if not identifier(g):
                raise StartError(f'output group name {shown(g)} must be a plain identifier')
            q = {k.name: coerce(f'outputs.{g}.{k.name}', values.get(f'outputs.{g}.{k.name}'), k)
                 for k in GROUP_PARAMS}
            groups.append(Group(g, q['topic'], q['joints'], q['indices'], q['hold']))
        why = prompt_problem(p.prompt, p.max_prompt_chars)
        if why:
            raise StartError(f'parameter prompt: {why}')
        cfg = _contract(p, groups)
        try:
            given = parse_limits({k: v for k, v in values.items() if is_limit(k)}, groups)
        except ValueError as e:
            raise StartError(f'parameter {e}') from None
        if given:
            cfg.limits = JointLimits(cfg.profile.action_dim, given, p.limit_hold_margin)
        elif p.robot != 'identity' and not p.allow_unlimited:
            # A real arm commanded without bounds takes whatever a wrong checkpoint or
            # normalisation says, at any speed: only on purpose.
            raise StartError(f"robot {p.robot} has no joint_limits: give its joints' limits "
                             f'(config/{p.robot}.yaml has them for the stock robot), or set '
                             f'allow_unlimited: true to command it without bounds on purpose')
        # none given for 'identity' (or allowed): no limits at all, and the start-up log says so
        return cfg

    @property
    def output_names(self) -> dict[int, str]:
        """Action index -> '<group>/<joint>' of the joint it drives, group by group (ALOHA's
        two arms share joint names: the group tells them apart)."""
        return {i: f'{g.name}/{j}' for g in self.groups
                for j, i in zip(g.joints, g.indices, strict=True)}

    @property
    def hold_setpoint(self) -> np.ndarray:
        """[action_dim] True where a hold keeps the last command (outputs.<group>.hold)."""
        keep = np.zeros(self.profile.action_dim, dtype=bool)
        for g in self.groups:
            if g.hold == 'setpoint':
                keep[g.indices] = True
        return keep

    @property
    def random_weights(self) -> bool:
        return not self.p.checkpoint

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
        model = self.p.checkpoint or f'model {self.p.model or "small"!r}'
        unknown = sorted(set(self.slots.values()) - set(slots))
        if unknown:
            raise StartError(f'camera_slots {unknown} are not slots of {model}: '
                             f'{list(slots)}')
        robot, prof = self.p.robot, self.profile
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
        if name == 'decode_k' and (value == 0) != (self.p.decode_k == 0):
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
        why = prompt_problem(text, self.p.max_prompt_chars)
        if why or self.prompt_tokens is None:
            return why
        n = self.prompt_tokens(text)
        if n <= self.max_token_len:
            return None
        if self.p.prompt_format == 'pi05':
            return (f'prompt of {n} tokens with the {self.profile.state_dim}-d state (each '
                    f'value at its longest) is over the model\'s max_token_len of '
                    f'{self.max_token_len}: the state would be cut off')
        return (f'prompt of {n} tokens is over the model\'s max_token_len of '
                f'{self.max_token_len}: it would be cut off')

    def assembler(self) -> Assembler:
        cams, optional = self.p.cameras, self.p.optional_cameras
        return Assembler(
            required=[c for c in cams if c not in optional]
            + [f'joints:{s}' for s in self.joint_topics],
            optional=optional,
            # Held samples may lie ahead of the clock by max_input_age (the Assembler's
            # default), not max_future_stamp, which judges a stamp as it arrives.
            max_input_age=self.p.max_input_age, max_skew=self.p.max_skew,
            # One frame per image of the main camera: joint states come faster and would
            # otherwise rerun the model on the same images.
            trigger=[next(c for c in cams if c not in optional)])


def _check_horizon(horizon: float, period: float) -> None:
    if horizon < period:
        raise StartError(f'max_command_horizon {horizon:g} s is shorter than one action period '
                         f'({period:g} s): no action could ever be sent')


def _contract(p: Values, groups: list[Group]) -> Config:
    try:
        options = safe_yaml.load(p.profile_options) if p.profile_options else {}
    except ValueError as e:
        raise StartError(f'profile_options: {e}') from None
    if not isinstance(options, dict):
        raise StartError(f'profile_options must be a YAML mapping, got {shown(options)}')
    if p.robot == 'identity':
        options.setdefault('dim', len(p.joints))
    try:
        profile = make_profile(p.robot, **options)
    except (TypeError, ValueError) as e:
        raise StartError(f'robot profile {p.robot!r}: {e}') from None

    cams = p.cameras
    if not cams:
        raise StartError('cameras is empty: name at least one camera')
    if len(set(cams)) != len(cams):
        raise StartError(f'cameras lists a name twice: {cams}')
    topics = p.camera_topics or [f'{c}/image_raw' for c in cams]
    if len(topics) != len(cams) or len(p.camera_slots) != len(cams):
        raise StartError(f'cameras ({len(cams)}), camera_topics ({len(topics)}) and '
                         f'camera_slots ({len(p.camera_slots)}) must have equal lengths')
    if len(set(p.camera_slots)) != len(cams):
        raise StartError(f'camera_slots lists a slot twice: {p.camera_slots}')
    topics, transports = _transports(cams, topics, p.camera_transports)
    unknown = sorted(set(p.optional_cameras) - set(cams))
    if unknown:
        raise StartError(f'optional_cameras names unknown cameras {unknown}; cameras: {cams}')
    if set(p.optional_cameras) == set(cams):
        raise StartError('every camera is optional: at least one must be required')

    jt = p.joint_topics
    if not jt:
        raise StartError('joint_topics is empty')
    sources = p.joint_sources or ([''] if len(jt) == 1 else [])
    if len(sources) != len(jt):
        raise StartError(f'joint_sources must name each of the {len(jt)} joint_topics, '
                         f'got {sources}')
    joint_topics = dict(zip(sources, jt, strict=True))
    labels = []
    for label in p.joints:
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
        raise StartError(f'{len(joint_map)} joints listed but the {p.robot} profile '
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
                             f'{profile.action_dim}-d action of {p.robot}')
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
    period = 1.0 / (p.action_rate_hz or p.control_rate_hz)
    _check_horizon(p.max_command_horizon, period)
    return Config(p, groups, profile, dict(zip(cams, topics, strict=True)),
                  dict(zip(cams, p.camera_slots, strict=True)), joint_topics, joint_map,
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
