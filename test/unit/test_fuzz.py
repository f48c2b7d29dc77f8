"""tools/fuzz.py in CI: a few hundred inputs of each target (the 1e5 runs are the tool's),
and the YAML reading it found problems in: aliases, deep nesting, dates that are not dates,
undecodable bytes, a file over the size cap, a value that cannot be a float."""
import sys

import pytest
from support.paths import TOOLS  # noqa: E402

sys.path.insert(0, str(TOOLS))

pytest.importorskip('cv2')
import fuzz  # noqa: E402

from oxygen_ros.robot import safe_yaml  # noqa: E402
from oxygen_ros.robot.params import (  # noqa: E402
    BY_NAME,
    StartError,
    coerce,
    command_line_params,
    read_robot_file,
)
from oxygen_ros.ros import fleet_file  # noqa: E402

EXAMPLES = {'raw': 400, 'compressed': 400, 'robot_file': 200, 'fleet_file': 300,
            'params': 200}


@pytest.mark.parametrize('target', list(fuzz.TARGETS))
def test_fuzz_target(target):
    r = fuzz.fuzz(target, EXAMPLES[target], batch=EXAMPLES[target], first_seed=1)
    assert r['inputs'] >= EXAMPLES[target]
    assert r['rss_end'] - r['rss_warm'] < 50 and r['max_rss'] - r['rss_warm'] < 512, r


def test_the_fuzzer_finds_an_undocumented_error(monkeypatch):
    # A check that fails is reported, not swallowed.
    def broken(text):
        raise KeyError('found')
    monkeypatch.setitem(fuzz.TARGETS, 'fleet_file', (fuzz.fleet_files(), broken))
    with pytest.raises(KeyError, match='found'):
        fuzz.fuzz('fleet_file', 20, batch=20)


def laughs(levels=9, width=9):
    lines = ['a0: &a0 [x]']
    lines += [f'a{d}: &a{d} [' + ', '.join([f'*a{d - 1}'] * width) + ']'
              for d in range(1, levels + 1)]
    return '\n'.join(lines) + '\n'


@pytest.mark.parametrize('text,why', [
    (laughs(), r'aliases \(\*name\) are not taken'),
    ('a: ' + '[' * 10_000 + ']' * 10_000, r'nested more than 64 brackets deep'),
    ('a: 2001-02-30', r'not YAML: ValueError: day is out of range'),
    ('!!timestamp 99999-01-01', r'not YAML: AttributeError'),
    (b'a: \xff\xfe\x00', r'not YAML'),
    ('a: ' + 'x' * (safe_yaml.MAX_BYTES + 1), r'over the 1048576 taken'),
])
def test_yaml_that_is_not_taken_is_a_value_error(text, why):
    with pytest.raises(ValueError, match=why):
        safe_yaml.load(text)


def test_files_and_command_lines_name_what_they_refuse(tmp_path):
    path = tmp_path / 'robot.yaml'
    path.write_text('n:\n  ros__parameters:\n' + ''.join(
        '    ' + line + '\n' for line in laughs().splitlines()) + '    prompt: *a9\n')
    with pytest.raises(StartError, match=rf'^robot r: robot_file {path}: not YAML: .*aliases'):
        read_robot_file('r', str(path))
    path.write_bytes(b'servers: {a: [left]}\n# \xff\n')
    with pytest.raises(ValueError, match=rf'^fleet file {path}: not YAML'):
        fleet_file.load(path)
    path.write_text('servers:\n  a: [[' + ', '.join(['x' * 100] * 100) + ']]\n')
    with pytest.raises(ValueError, match=r"server a: robot \['x+\.\.\.x+', .*\] is not a "
                       'plain name$') as e:
        fleet_file.load(path)
    assert len(str(e.value)) < 1000
    # ROS keeps a -p value it cannot read as YAML as its text; so does the node.
    assert command_line_params(['--ros-args', '-p', 'prompt:=2001-02-30', '-p', 'seed:=[[1]'],
                               'oxygen_node') == {'prompt': '2001-02-30', 'seed': '[[1]'}


def test_values_in_messages_are_cut_short():
    with pytest.raises(StartError) as e:
        coerce('prompt', ['x' * 10**6] * 1000, BY_NAME['prompt'])
    assert len(str(e.value)) < 1000  # of a billion characters
    with pytest.raises(StartError, match='control_rate_hz must be finite, got inf'):
        coerce('control_rate_hz', 10**400, BY_NAME['control_rate_hz'])
