"""The node's ROS-free parts: the parameter table and robot contract (contract.py)."""
import functools
import math
import re

import numpy as np
import pytest
from support.paths import ROOT  # noqa: E402

from oxygen_ros.robot.contract import Config
from oxygen_ros.robot.params import BY_NAME, PARAMS, StartError, coerce, command_line_params

ARM = [f'fr3_joint{i}' for i in range(1, 8)]

DROID = {
    'robot': 'droid', 'profile_options': '{velocity: true}',
    'cameras': ['front', 'wrist'], 'camera_slots': ['base_0_rgb', 'left_wrist_0_rgb'],
    'joints': ARM + ['gripper'], 'action_rate_hz': 10.0, 'output_groups': ['arm', 'gripper'],
    'outputs.arm.topic': 'arm/joint_trajectory', 'outputs.arm.joints': ARM,
    'outputs.arm.indices': list(range(7)),
    'outputs.gripper.topic': 'gripper/joint_trajectory', 'outputs.gripper.joints': ['gripper'],
    'outputs.gripper.indices': [7],
    'allow_unlimited': True,  # the contract's checks, not the limits (test_limits)
}

LEFT = ['waist', 'shoulder', 'elbow', 'forearm_roll', 'wrist_angle', 'wrist_rotate']
ALOHA = {
    'robot': 'aloha', 'cameras': ['cam_high'], 'camera_slots': ['base_0_rgb'],
    'joint_topics': ['l/joint_states', 'r/joint_states'], 'joint_sources': ['left', 'right'],
    'joints': [f'left/{j}' for j in LEFT] + ['left/left_finger']
    + [f'right/{j}' for j in LEFT] + ['right/left_finger'],
    'output_groups': ['left_gripper', 'right_arm'],
    'outputs.left_gripper.topic': 'l/g', 'outputs.left_gripper.joints': ['gripper'],
    'outputs.left_gripper.indices': [6],
    'outputs.right_arm.topic': 'r/a', 'outputs.right_arm.joints': LEFT,
    'outputs.right_arm.indices': list(range(7, 13)),
    'allow_unlimited': True,
}


def test_an_aloha_without_limits_is_refused():
    with pytest.raises(StartError, match=r'robot aloha has no joint_limits: .*config/aloha.yaml '
                       r'has them .* allow_unlimited: true'):
        Config.from_values({**ALOHA, 'allow_unlimited': False})


def test_problem_key_ignores_numbers():
    from oxygen_ros.robot.inputs import problem_key

    a = problem_key('frame', 'cam stale (612 ms old, limit 500 ms)')
    b = problem_key('frame', 'cam stale (1204 ms old, limit 500 ms)')
    assert a == b == 'frame:cam stale'
    assert problem_key('frame', 'wrist stale (1 ms old)') != a
    assert problem_key('frame', 'the 1234-byte JPEG is corrupt') == (
        'frame:the #byte JPEG is corrupt')


def test_problem_key_leaves_out_what_a_sender_controls():
    # Encodings, format strings and payload bytes are quoted or bracketed in the messages:
    # whatever a sender puts there, the key is the same.
    from oxygen_ros.robot.images import check_payload, image_problem, parse_format
    from oxygen_ros.robot.inputs import problem_key

    class Msg:
        height, width, step, data = 2, 2, 6, bytes(12)

    keys = set()
    for text in ('foo', "it's", 'a"b', 'x' * 500, '\n(', 'bayer_xyz', ''):
        m = Msg()
        m.encoding = text
        keys.add(problem_key('image:cam', image_problem(m)))
        for fmt in (text, f'{text}; jpeg compressed bgr8', f'rgb8; jpeg compressed {text}'):
            with pytest.raises(ValueError) as e:
                parse_format(fmt)
            keys.add(problem_key('image:cam', str(e.value)))
        with pytest.raises(ValueError) as e:
            check_payload(parse_format('rgb8; png compressed bgr8'), text.encode() + b'!')
        keys.add(problem_key('image:cam', str(e.value)))
    # One key per kind of problem: unknown encoding, unknown format, unknown encoding in a
    # format, a target image_transport never writes, not a PNG.
    assert len(keys) <= 6, keys
    assert all(len(k) <= 100 for k in keys)


def test_parameter_types_are_checked_by_name():
    spec = BY_NAME
    assert coerce('control_rate_hz', 70, spec['control_rate_hz']) == 70.0
    assert isinstance(coerce('control_rate_hz', 70, spec['control_rate_hz']), float)
    assert coerce('cameras', None, spec['cameras']) == []
    assert coerce('threads', None, spec['threads']) == 1
    with pytest.raises(StartError, match='parameter threads must be int'):
        coerce('threads', True, spec['threads'])
    with pytest.raises(StartError, match=r'parameter cameras must be str\[\]'):
        coerce('cameras', ['a', 3], spec['cameras'])
    with pytest.raises(StartError, match='parameter control_rate_hz must be float'):
        coerce('control_rate_hz', '70', spec['control_rate_hz'])


@pytest.mark.parametrize('name, value, message', [
    ('control_rate_hz', 0.0, 'must be > 0'),
    ('control_rate_hz', math.inf, 'must be finite'),
    ('control_rate_hz', 1e300, r'must be > 0 and <= 1000, got 1e\+300'),
    ('action_rate_hz', math.nan, 'must be finite, got nan'),
    ('max_input_age', 60.0, 'must be > 0 and <= 10, got 60.0'),
    ('max_skew', -0.1, 'must be >= 0'),
    ('decode_k', -1, 'must be >= 0'),
    ('admission', 'first', 'must be one of drop_oldest, reject_newest, wait'),
    ('robot', 'ur5', 'must be one of identity, aloha, droid'),
    ('mode', 'parallel', 'must be one of oxygen, shared_kv, isolated'),
])
def test_ranges_and_choices(name, value, message):
    with pytest.raises(StartError, match=f'parameter {name} {message}'):
        coerce(name, value, BY_NAME[name])


# Floats that are no rate, time or size: sampling and guidance weights.
UNBOUNDED = {'temperature', 'rtc_beta'}


def test_every_rate_time_and_size_is_finite_and_bounded():
    floats = {p.name: p for p in PARAMS if p.type == 'float'}
    assert set(floats) - UNBOUNDED == {p for p in floats if floats[p].high is not None}
    for name, p in floats.items():
        for bad in (math.nan, math.inf, -math.inf):
            with pytest.raises(StartError, match=f'parameter {name} must be finite'):
                coerce(name, bad, p)
        if p.high is None:
            continue
        assert math.isfinite(p.high) and p.high > max(p.low, p.default), name
        assert coerce(name, p.high, p) == p.high
        with pytest.raises(StartError, match=f'parameter {name} must be .*<= {p.high:g}'):
            coerce(name, p.high * (1 + 1e-9), p)


def test_every_parameter_has_a_description_and_a_valid_default():
    for p in PARAMS:
        assert p.description, p.name
        coerce(p.name, p.default, p)


def test_docs_list_every_parameter_with_its_default():
    # docs/robots.md is where users look a parameter up: a new one must be listed there.
    import re

    docs = (ROOT / 'docs' / 'robots.md').read_text()
    rows = dict(re.findall(r'^\| `([a-z_<>.]+)` \| `([^`]*)` \|', docs, re.M))
    for p in PARAMS:
        assert p.name in rows, f'{p.name} is not in the parameter table of docs/robots.md'
        if isinstance(p.default, bool):
            shown = 'true' if p.default else 'false'
        else:
            shown = '[]' if p.default is None else repr(p.default)
        assert rows[p.name] == shown, (p.name, rows[p.name], shown)


def test_robot_file_against_what_the_checkpoint_states():
    cfg = Config.from_values(DROID)
    slots = ('base_0_rgb', 'left_wrist_0_rgb', 'right_wrist_0_rgb')
    cfg.check_engine(slots, 8, None)  # random weights: no state dims stated
    cfg.check_engine(slots, 32, 32)  # openpi: a state of at most 32
    with pytest.raises(StartError, match=r"camera_slots \['left_wrist_0_rgb'\] are not slots"):
        cfg.check_engine(('base_0_rgb', 'wrist'), 8)
    with pytest.raises(StartError, match='droid profile needs 8-d actions but .* has 7'):
        cfg.check_engine(slots, 7)
    with pytest.raises(StartError, match='8-d state but .* takes at most 6'):
        cfg.check_engine(slots, 8, 6)
    with pytest.raises(StartError, match='8-d state but .* takes exactly 9'):
        cfg.check_engine(slots, 8, 9, exact_state=True)


def test_the_engine_runs_the_scheduling_mode_the_node_is_given():
    from oxygen_ros.engine.scheduler import MODES

    assert Config.from_values(DROID).engine_settings()['mode'] == 'oxygen'
    for mode in BY_NAME['mode'].choices:
        assert mode in MODES
        assert Config.from_values({**DROID, 'mode': mode}).engine_settings()['mode'] == mode


def test_command_line_rules_for_this_node_only():
    argv = ['oxygen_node', '--ros-args', '--params-file', 'a.yaml', '-p', 'control_rate_hz:=fast',
            '-p', 'other_node:seed:=3', '-p', 'oxygen_node:threads:=2', '--param', 'cameras:=[a]',
            '-r', 'x:=y', '--', '-p', 'ignored:=1']
    assert command_line_params(argv, 'oxygen_node') == {
        'control_rate_hz': 'fast', 'threads': 2, 'cameras': ['a']}


def test_contract_of_a_droid():
    c = Config.from_values(DROID)
    assert c.cameras == {'front': 'front/image_raw', 'wrist': 'wrist/image_raw'}
    assert c.joint_topics == {'': 'joint_states'}
    assert c.wanted == {'': set(ARM + ['gripper'])}
    assert c.action_period == pytest.approx(0.1)
    assert c.random_weights
    assert c.hold_sources == {i: ('', j) for i, j in enumerate(ARM + ['gripper'])}
    a = c.assembler()
    assert a.required == ['front', 'wrist', 'joints:'] and a.trigger == {'front'}


def test_aloha_holds_read_the_controller_joint_from_the_arm_of_the_action():
    c = Config.from_values(ALOHA)
    # The gripper servo is not a state joint: it is read from the left arm's topic.
    assert c.hold_sources[6] == ('left', 'gripper')
    assert c.hold_sources[7] == ('right', 'waist')
    assert c.hold_sources[12] == ('right', 'wrist_rotate')


@pytest.mark.parametrize('name, grippers', [('aloha.yaml', [6, 13]), ('droid.yaml', [7]),
                                             ('sim.yaml', [7])])
def test_the_shipped_robot_files_hold_their_grippers_at_the_setpoint(name, grippers):
    from support.robots import robot_config

    keep = robot_config(name).hold_setpoint
    assert np.flatnonzero(keep).tolist() == grippers
    assert not Config.from_values(DROID).hold_setpoint.any()  # the default: the reading


@pytest.mark.parametrize('change, message', [
    ({'outputs.gripper.hold': 'setpiont'},
     "outputs.gripper.hold must be one of reading, setpoint, got 'setpiont'"),
    ({'camera_slots': ['base_0_rgb']}, 'must have equal lengths'),
    ({'joints': ARM}, '7 joints listed but the droid profile takes a 8-d state'),
    ({'outputs.gripper.indices': [8]}, r'outputs.gripper.indices \[8\] outside the 8-d action'),
    ({'output_groups': ['arm', 'bad-name']}, "output group name 'bad-name'"),
    ({'max_command_horizon': 0.05}, 'shorter than one action period'),
    ({'prompt': '  '}, 'parameter prompt: empty prompt'),
    ({'profile_options': '[1, 2]'}, 'profile_options must be a YAML mapping'),
    # A copied output group: one action drives two controllers' joints.
    ({'outputs.gripper.indices': [6]},
     'action index 6 is in outputs.arm.indices and outputs.gripper.indices'),
    ({'outputs.arm.indices': [0, 1, 2, 3, 4, 5, 5]}, 'outputs.arm.indices lists 5 twice'),
    ({'outputs.arm.joints': ARM[:6] + ['fr3_joint1']},
     'outputs.arm.joints lists fr3_joint1 twice'),
    ({'outputs.gripper.topic': 'arm/joint_trajectory/'},
     "outputs.arm.topic 'arm/joint_trajectory' and outputs.gripper.topic "
     "'arm/joint_trajectory/' are one topic"),
    # Profile options are checked as the parameters are (YAML: 1e300 is a string).
    ({'profile_options': '{velocity_scale: .nan}'}, 'option velocity_scale must be finite'),
    ({'profile_options': '{velocity_scale: 1.0e+300}'},
     r'option velocity_scale must be finite and in \(0, 1\], got 1e\+300'),
    ({'profile_options': '{velocity_scale: 1e300}'},
     "option velocity_scale must be a number, got '1e300'"),
    ({'profile_options': '{gripper_closed: -.inf}'}, 'option gripper_closed must be finite'),
    ({'profile_options': '{velocity: "false"}'},
     "option velocity must be true or false, got 'false'"),
])
def test_contract_mistakes_are_one_line(change, message):
    with pytest.raises(StartError, match=message):
        Config.from_values({**DROID, **change})


def test_copied_output_groups_are_refused_but_a_joint_name_may_repeat():
    arm = {'output_groups': ['left_arm', 'right_arm'],
           'outputs.left_arm.topic': 'l/a', 'outputs.left_arm.joints': LEFT,
           'outputs.left_arm.indices': list(range(6)),
           'outputs.right_arm.topic': 'r/a', 'outputs.right_arm.joints': LEFT,
           'outputs.right_arm.indices': list(range(6))}
    with pytest.raises(StartError, match='action index 0 is in outputs.left_arm.indices and '
                       'outputs.right_arm.indices: each action drives one joint'):
        Config.from_values({**ALOHA, **arm})
    # Each arm's controller names its joints alike (ALOHA's `gripper`, `waist`, ...).
    c = Config.from_values({**ALOHA, **arm, 'outputs.right_arm.indices': list(range(7, 13))})
    assert [g.joints for g in c.groups] == [LEFT, LEFT]


def test_parameters_are_read_by_name_and_a_misspelt_one_is_an_error():
    c = Config.from_values({**DROID, 'max_new_tokens': 20})
    assert c.p.max_new_tokens == c.p['max_new_tokens'] == 20
    assert c.p.control_rate_hz == BY_NAME['control_rate_hz'].default
    with pytest.raises(AttributeError, match="no parameter 'max_new_token'"):
        _ = c.p.max_new_token
    with pytest.raises(AttributeError, match="no parameter 'contrl_rate_hz'"):
        c.p.contrl_rate_hz = 50.0
    assert 'contrl_rate_hz' not in c.p
    c.p.max_new_tokens = 7
    assert c.p['max_new_tokens'] == 7


def test_live_parameters():
    c = Config.from_values({**DROID, 'max_new_tokens': 20})
    # Before configure no KV cache is sized: any valid budget may be set.
    assert c.check_live('max_new_tokens', 40) == 40
    c.sized_tokens = 20  # configured: the cache holds 20 tokens per request
    assert c.check_live('temperature', 1) == 1.0
    assert c.check_live('max_new_tokens', 10) == 10
    c.p.max_new_tokens = 10
    assert c.check_live('max_new_tokens', 20) == 20  # lowered, it may go back up to 20
    assert c.check_live('play_steps', 3) == 3
    for name, value, message in [
        ('control_rate_hz', 50.0, 'control_rate_hz cannot change while the node runs'),
        ('device', 'cuda', 'device cannot change'),
        ('temperature', -1.0, 'must be >= 0'),
        ('temperature', 'hot', 'must be float'),
        ('max_new_tokens', 21, 'may not exceed 20'),
        ('decode_k', 0, 'between adaptive'),
        ('max_command_horizon', 0.01, 'shorter than one action period'),
        ('prompt', '', 'empty prompt'),
        ('nonsense', 1, 'nonsense cannot change'),
    ]:
        with pytest.raises(StartError, match=message):
            c.check_live(name, value)


def test_a_prompt_whose_tokens_would_cut_off_the_state_is_refused():
    """Once configured, a robot's prompt must leave room for its state: the tokenizer cuts
    the prefix text at the model's max_token_len, and the state comes last."""
    from oxygen_ros.model.tokenizer import Tokenizer, action_prompt, prompt_tokens, subtask_prompt

    tok = Tokenizer.default()
    c = Config.from_values(DROID)
    assert c.check_prompt('pick up the cup' + ' a' * 40) is None  # before: characters only
    c.prompt_tokens = functools.partial(prompt_tokens, tok, state_dim=8, prompt_format='pi05')

    def count(task):  # every state value at its longest, bin 255 (test_tokenizer)
        return len(tok.encode(action_prompt(task, np.ones(8))))

    tasks = {count(t): t for t in ('pick up the cup' + ' a' * k for k in range(8))}
    limit = min(tasks) + 3
    assert {limit - 1, limit, limit + 1} <= set(tasks)
    c.max_token_len = limit
    assert c.check_prompt(tasks[limit - 1]) is None and c.check_prompt(tasks[limit]) is None
    said = (f"prompt of {limit + 1} tokens with the 8-d state (each value at its longest) is "
            f"over the model's max_token_len of {limit}: the state would be cut off")
    assert c.check_prompt(tasks[limit + 1]) == said
    with pytest.raises(StartError, match=re.escape(f'prompt: {said}')):
        c.check_live('prompt', tasks[limit + 1])
    assert c.check_live('prompt', tasks[limit]) == tasks[limit]

    def kept(task):  # what of the prefix text the model gets
        ids, mask = tok.tokenize(action_prompt(task, np.ones(8)), limit)
        return tok.decode(ids[mask])

    assert kept(tasks[limit]) == action_prompt(tasks[limit], np.ones(8))
    assert not kept(tasks[limit + 1]).endswith(';\nAction: ')  # what was refused
    # The subtask format has no state: only its own tokens count.
    c.p.prompt_format = 'subtask'
    c.prompt_tokens = functools.partial(prompt_tokens, tok, state_dim=8,
                                        prompt_format='subtask')
    n = len(tok.encode(subtask_prompt(tasks[limit + 1])))
    c.max_token_len = n
    assert c.check_prompt(tasks[limit + 1]) is None
    c.max_token_len = n - 1
    assert c.check_prompt(tasks[limit + 1]) == (f"prompt of {n} tokens is over the model's "
                                                f"max_token_len of {n - 1}: it would be cut off")


def test_glitches_follow_the_speed_factor_and_a_rebase_takes_the_next_reading():
    """A reading that moved further than glitch_speed_factor x the speed limit allows since
    the last one is dropped; after a rebase (a new activation) the next one is taken as it
    comes, but a reading beyond the range stays a glitch."""
    from types import SimpleNamespace

    from oxygen_ros.robot.inputs import GLITCH_SLACK_S, Inputs
    from oxygen_ros.robot.report import Reporter

    def state(t, x):
        sec = int(t)
        return SimpleNamespace(name=['waist'], position=[x], header=SimpleNamespace(
            stamp=SimpleNamespace(sec=sec, nanosec=int(round((t - sec) * 1e9)))))

    limits = {'joint_limits.right_arm.waist.lower': -1.0,
              'joint_limits.right_arm.waist.upper': 1.0,
              'joint_limits.right_arm.waist.velocity': 1.0}
    for factor in (1.5, 8.0):
        cfg = Config.from_values(dict(ALOHA, **limits, glitch_speed_factor=factor))
        said = []
        inputs = Inputs(cfg, Reporter(said.append, period=0.0), lambda: 10.0)
        reader = inputs.readings['right']
        inputs.joints('right', state(9.0, 0.0))
        # 0.2 rad in 20 ms at 1 rad/s: factor * (0.02 + slack) rad are allowed.
        inputs.joints('right', state(9.02, 0.2))
        taken = reader.last('waist')[0] == 0.2
        assert taken == (0.2 <= factor * (0.02 + GLITCH_SLACK_S)), (factor, said)
        assert taken == (factor == 8.0)
    # A rebase: a 0.9 rad jump in one step is taken; the one after is judged again.
    inputs.rebase()
    inputs.joints('right', state(9.04, -0.7))
    assert reader.last('waist')[0] == -0.7
    inputs.joints('right', state(9.06, 0.7))
    assert reader.last('waist')[0] == -0.7 and 'a glitch' in said[-1]
    inputs.rebase()
    inputs.joints('right', state(9.08, 1.5))  # beyond the range by more than the margin
    assert reader.last('waist')[0] == -0.7 and 'beyond its range' in said[-1]
    # And the next frame waits for a trigger input that came after the rebase.
    inputs.assembler.put('cam_high', object(), 9.08)
    assert inputs.assembler.fresh()
    inputs.rebase()
    assert not inputs.assembler.fresh()
