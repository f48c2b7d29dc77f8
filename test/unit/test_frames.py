"""Frame assembly, image conversion and problem reporting, without ROS."""
from types import SimpleNamespace

import numpy as np
import pytest

from oxygen_ros.robot.frames import Assembler, JointReadings
from oxygen_ros.robot.images import check_image, image_problem, image_to_rgb, to_rgb
from oxygen_ros.robot.report import Reporter

# A 2x3 RGB image with distinct values in every channel of every pixel.
RGB = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3) * 7


def pack(px: np.ndarray, pad: int = 0) -> tuple[int, bytes]:
    """(step, data) of an HxWxC array with `pad` bytes at the end of each row."""
    h = px.shape[0]
    rows = px.reshape(h, -1)
    rows = np.concatenate([rows, np.full((h, pad), 255, np.uint8)], axis=1)
    return rows.shape[1], rows.tobytes()


def test_ready_when_all_inputs_fresh_and_close():
    a = Assembler(['cam', 'joints'], max_input_age=0.5, max_skew=0.1)
    a.put('cam', 'img', 10.0)
    a.put('joints', 'q', 10.05)
    frame, why = a.ready(10.1)
    assert why is None
    assert frame.values == {'cam': 'img', 'joints': 'q'}
    assert frame.stamp == 10.05
    assert frame.stamps == {'cam': 10.0, 'joints': 10.05}


def test_missing_input_is_named():
    a = Assembler(['cam', 'joints'])
    a.put('cam', 'img', 1.0)
    frame, why = a.ready(1.0)
    assert frame is None
    assert 'joints' in why and 'missing' in why and 'cam' not in why


def test_stale_input_is_named_with_its_age():
    a = Assembler(['cam', 'joints'], max_input_age=0.5, max_skew=10)
    a.put('cam', 'img', 1.0)
    a.put('joints', 'q', 1.6)
    frame, why = a.ready(1.7)
    assert frame is None
    assert 'cam stale (700 ms old, limit 500 ms)' in why


def test_skewed_inputs_are_named():
    a = Assembler(['cam', 'joints'], max_input_age=1.0, max_skew=0.1)
    a.put('cam', 'img', 1.0)
    a.put('joints', 'q', 1.3)
    frame, why = a.ready(1.3)
    assert frame is None
    assert 'cam is 300 ms older than joints' in why


def test_same_data_is_not_run_twice():
    a = Assembler(['cam'])
    a.put('cam', 'img', 1.0)
    assert a.ready(1.0)[0] is not None
    frame, why = a.ready(1.01)
    assert frame is None and 'no new input' in why
    a.put('cam', 'img2', 1.02)
    assert a.ready(1.03)[0].values['cam'] == 'img2'


def test_latest_sample_is_held():
    a = Assembler(['cam', 'joints'])
    a.put('joints', 'q0', 1.0)
    a.put('joints', 'q1', 1.01)
    a.put('cam', 'img', 1.02)
    assert a.ready(1.05)[0].values['joints'] == 'q1'


def test_optional_input_is_left_out_not_blocking():
    a = Assembler(['cam'], optional=['wrist'], max_input_age=0.5)
    a.put('cam', 'img', 2.0)
    a.put('wrist', 'old', 1.0)
    frame, why = a.ready(2.0)
    assert why is None
    assert frame.values == {'cam': 'img', 'wrist': None}
    assert 'wrist stale' in frame.notes[0]
    # A stale optional input does not count toward the skew either.
    assert frame.stamps == {'cam': 2.0}


def test_unknown_input_and_bad_limits_raise():
    a = Assembler(['cam'])
    with pytest.raises(KeyError, match='unknown input'):
        a.put('other', 1, 0.0)
    with pytest.raises(ValueError):
        Assembler([])
    with pytest.raises(ValueError):
        Assembler(['cam'], max_input_age=0)


@pytest.mark.parametrize('pad', [0, 3])
def test_rgb8(pad):
    step, data = pack(RGB, pad)
    np.testing.assert_array_equal(to_rgb('rgb8', 2, 3, step, data), RGB)


@pytest.mark.parametrize('pad', [0, 1])
def test_bgr8(pad):
    step, data = pack(RGB[:, :, ::-1], pad)
    np.testing.assert_array_equal(to_rgb('bgr8', 2, 3, step, data), RGB)


@pytest.mark.parametrize('pad', [0, 4])
def test_rgba8(pad):
    alpha = np.full((2, 3, 1), 9, np.uint8)
    step, data = pack(np.concatenate([RGB, alpha], axis=2), pad)
    np.testing.assert_array_equal(to_rgb('rgba8', 2, 3, step, data), RGB)


@pytest.mark.parametrize('pad', [0, 2])
def test_bgra8(pad):
    alpha = np.full((2, 3, 1), 9, np.uint8)
    step, data = pack(np.concatenate([RGB[:, :, ::-1], alpha], axis=2), pad)
    out = to_rgb('bgra8', 2, 3, step, data)
    np.testing.assert_array_equal(out, RGB)
    assert out.flags.c_contiguous and out.dtype == np.uint8


@pytest.mark.parametrize('pad', [0, 5])
def test_mono8(pad):
    gray = np.array([[0, 10, 20], [30, 40, 255]], np.uint8)
    step, data = pack(gray[:, :, None], pad)
    out = to_rgb('mono8', 2, 3, step, data)
    assert out.shape == (2, 3, 3)
    for c in range(3):
        np.testing.assert_array_equal(out[:, :, c], gray)


def test_result_does_not_alias_the_buffer():
    step, data = pack(RGB)
    buf = bytearray(data)
    out = to_rgb('rgb8', 2, 3, step, buf)
    buf[0] = 123
    assert out[0, 0, 0] == RGB[0, 0, 0]


def test_unsupported_encoding_is_named():
    with pytest.raises(ValueError, match="unsupported image encoding '16UC1'"):
        to_rgb('16UC1', 2, 3, 6, bytes(12))


@pytest.mark.parametrize(
    'args, match',
    [
        (('rgb8', 2, 3, 9, bytes(10)), 'has 10 bytes'),
        (('rgb8', 2, 3, 8, bytes(18)), 'step 8 is shorter'),
        (('rgb8', 0, 3, 9, b''), 'no pixels'),
        (('mono8', 4, 4, 4, bytes(15)), 'has 15 bytes'),
    ],
)
def test_wrong_sizes_are_explained(args, match):
    with pytest.raises(ValueError, match=match):
        to_rgb(*args)


def test_check_image_returns_channels():
    assert check_image('bgra8', 1, 2, 8, 8) == 4
    assert check_image('mono8', 1, 2, 2, 2) == 1


def test_message_helpers():
    step, data = pack(RGB[:, :, ::-1])
    msg = SimpleNamespace(encoding='bgr8', height=2, width=3, step=step, data=data)
    assert image_problem(msg) is None
    np.testing.assert_array_equal(image_to_rgb(msg), RGB)
    bad = SimpleNamespace(encoding='rgb8', height=2, width=3, step=step, data=data[:5])
    assert 'has 5 bytes' in image_problem(bad)


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_reporter_limits_repeats_and_counts_them():
    said = []
    clock = FakeClock()
    r = Reporter(said.append, period=5.0, clock=clock)
    assert r.report('stale', 'cam stale')
    for _ in range(3):
        clock.t += 1.0
        assert not r.report('stale', 'cam stale')
    assert r.report('other', 'bad encoding')
    clock.t = 5.5
    assert r.report('stale', 'cam stale')
    assert said == ['cam stale', 'bad encoding', 'cam stale (3 more since the last report)']
    assert r.totals == {'stale': 5, 'other': 1}
    assert r.count('st') == 5 and r.count() == 6
    assert r.recent[-1].startswith('cam stale (3')


def test_reporter_clear_says_again_at_once():
    said = []
    r = Reporter(said.append, period=100.0, clock=FakeClock())
    r.report('hold', 'holding')
    r.clear('hold')
    r.report('hold', 'holding')
    assert said == ['holding', 'holding']


def test_only_trigger_inputs_start_a_frame():
    a = Assembler(['cam', 'joints'], trigger=['cam'])
    a.put('cam', 'img', 1.0)
    a.put('joints', 'q0', 1.0)
    assert a.ready(1.0)[0] is not None
    a.put('joints', 'q1', 1.01)
    assert not a.fresh()
    assert a.ready(1.02)[0] is None
    a.put('cam', 'img2', 1.03)
    assert a.ready(1.04)[0].values == {'cam': 'img2', 'joints': 'q1'}
    with pytest.raises(ValueError, match='trigger'):
        Assembler(['cam'], trigger=['nope'])


def test_a_stopped_trigger_is_named_stale():
    a = Assembler(['cam', 'joints'], trigger=['cam'], max_input_age=0.5)
    a.put('cam', 'img', 1.0)
    a.put('joints', 'q', 1.0)
    assert a.ready(1.0)[0] is not None
    a.put('joints', 'q', 1.7)
    frame, why = a.ready(1.7)
    assert frame is None and why.startswith('cam stale')


def test_other_inputs_are_taken_at_the_trigger_time():
    # A camera image that waited 80 ms while joints kept coming at 100 Hz is not skewed:
    # the joint reading taken with the image is used.
    a = Assembler(['cam', 'joints'], trigger=['cam'], max_input_age=0.5, max_skew=0.05)
    for i in range(20):
        a.put('joints', f'q{i}', 1.0 + i * 0.01)
    a.put('cam', 'img', 1.11)
    frame, why = a.ready(1.2)
    assert why is None
    assert frame.values == {'cam': 'img', 'joints': 'q11'}
    assert frame.stamp == pytest.approx(1.11)


def test_old_samples_are_pruned():
    a = Assembler(['joints'], max_input_age=0.5, max_skew=0.1)
    for i in range(200):
        a.put('joints', i, i * 0.01)
    held = a._samples['joints']
    assert len(held) <= Assembler.HISTORY
    assert held[0].stamp >= 1.99 - 0.6 - 1e-9


def test_joint_readings_merge_and_age_by_their_oldest_joint():
    r = JointReadings(['a', 'b'], keep=['servo'])
    assert r.keep == {'a', 'b', 'servo'}
    values, oldest = r.update({'a': 1, 'b': 2, 'servo': 3, 'other': 9}, 10.0)
    assert values == {'a': 1.0, 'b': 2.0, 'servo': 3.0} and oldest == 10.0
    # A message with only `a`: `b` keeps its value and its age.
    values, oldest = r.update({'a': 1.5}, 10.3)
    assert values == {'a': 1.5, 'b': 2.0, 'servo': 3.0} and oldest == 10.0
    assert r.gone(10.3, 0.25) == ['b'] and r.gone(10.3, 0.5) == []
    assert r.get('servo') == 3.0 and r.get('other') is None
    # Joints never read do not count; with none read yet the message's own stamp does.
    fresh = JointReadings(['a', 'b'])
    assert fresh.update({'a': 0.0}, 5.0) == ({'a': 0.0}, 5.0)
    assert JointReadings(['a']).update({'x': 1.0}, 7.0) == ({}, 7.0)
