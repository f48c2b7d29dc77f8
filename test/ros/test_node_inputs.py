"""Bounded inputs on the running oxygen_node, over rclpy against its own process: a raw
front camera and a compressed (PNG) wrist camera, small caps (max_image_pixels 10000,
max_image_bytes 40000). An oversized raw image, a TIFF bomb and a flood of made-up
encodings are dropped with a message naming the problem while the good images in between
keep the node commanding, and the Reporter's keys do not grow with what a sender invents;
~/ask refuses an overlong question before tokenizing it, refuses goals past
max_open_questions with the reason, and ends a question whose frame never comes with reason
timeout.
"""
import random
import re
import string
import time

import numpy as np
import pytest

rclpy = pytest.importorskip('rclpy')
cv2 = pytest.importorskip('cv2')
from action_msgs.msg import GoalStatus  # noqa: E402
from rclpy.action import ActionClient  # noqa: E402
from rclpy.qos import qos_profile_sensor_data  # noqa: E402
from sensor_msgs.msg import CompressedImage, Image  # noqa: E402
from support.node import (  # noqa: E402
    PARAMS,
    Robot,
    assert_alive_and_commanding,
    expect_log,
    image,
    log_after,
    node_process,
)
from support.process import new_domain, wait_for  # noqa: E402

import oxygen_ros.action as action_mod  # noqa: E402 (built by colcon; must import)
from oxygen_ros.robot.images import encode  # noqa: E402
from oxygen_ros.sim.scene import render  # noqa: E402

Ask = action_mod.Ask
PIXELS, BYTES = 10_000, 40_000  # the 64x48 test images take 3072 pixels, 9216 raw bytes
OPEN, TIMEOUT_S = 3, 3.0
INPUTS = dict(PARAMS, camera_topics=['front/image', 'wrist/image'],
              camera_transports=['raw', 'compressed'], max_image_pixels=PIXELS,
              max_image_bytes=BYTES, max_open_questions=OPEN, question_timeout=TIMEOUT_S)
SCENE = render(64, 48, seed=2)
# What the engine's QUESTION_FORMAT, 'Question: {question}\nAnswer: ', adds.
FORMAT_CHARS = len('Question: \nAnswer: ')
SUCCEEDED, ABORTED = GoalStatus.STATUS_SUCCEEDED, GoalStatus.STATUS_ABORTED


class Cameras(Robot):
    """support/node.py's fake robot with front raw on /front/image and wrist a PNG on
    /wrist/image/compressed; `bad_image[cam]` breaks every second image; `asks` sends
    ~/ask goals."""

    def __init__(self, node):
        super().__init__(node)
        self.leave_out = set()
        best = qos_profile_sensor_data
        self.cams = {'front': node.create_publisher(Image, '/front/image', best),
                     'wrist': node.create_publisher(CompressedImage, '/wrist/image/compressed',
                                                    best)}
        self.client = ActionClient(node, Ask, '/oxygen_node/ask')

    def _images(self):
        self.n += 1
        for cam, pub in self.cams.items():
            if cam in self.paused:
                continue
            if cam == 'front':
                m = image(stamp=self._stamp())
            else:
                m = CompressedImage()
                m.header.stamp = self._stamp()
                m.format, data = encode(np.roll(SCENE, self.n % 8, axis=1), 'rgb8', 'png', 3)
                m.data = data
            if cam in self.bad_image and self.n % 2:
                m = self.bad_image[cam](m)
            pub.publish(m)

    def ask(self, *questions):
        """Goals sent together; each one's (status, result) future."""
        assert self.client.wait_for_server(timeout_sec=30), 'no ~/ask server'
        sent = [self.client.send_goal_async(Ask.Goal(question=q)) for q in questions]
        out = []
        for f in sent:
            assert wait_for(f.done, 30), 'goal not answered'
            assert f.result().accepted
            out.append(f.result().get_result_async())
        return out


def result(future, timeout=30):
    assert wait_for(future.done, timeout), 'no result'
    r = future.result()
    return r.status, r.result


@pytest.fixture(scope='module')
def robot(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('inputs')
    with node_process(tmp, INPUTS, new_domain(120, 220), 'bounded_robot', Cameras) as (proc, r):
        r.proc = proc
        assert wait_for(lambda: len(r.traj) > 20 or proc.poll() is not None, 90), r.log()
        assert proc.poll() is None, r.log()
        yield r


@pytest.fixture(autouse=True)
def alive(robot):
    yield
    robot.bad_image.clear()
    robot.paused.clear()
    assert robot.proc.poll() is None, robot.log()[-3000:]
    assert 'Traceback' not in robot.log(), robot.log()[-3000:]


def test_an_oversized_raw_image_is_dropped_and_named(robot):
    mark = len(robot.log())
    robot.bad_image['front'] = lambda m: image(128, 96, m.header.stamp)  # 12288 pixels
    expect_log(robot, mark, r'camera front: image of 128x96 pixels is over max_image_pixels '
               r'\(10000\); image dropped')
    assert_alive_and_commanding(robot, INPUTS)  # the good images in between

    def padded(m):
        m.step = 1000  # 48 rows of 1000 bytes: 48000, a short buffer made long
        m.data = bytes(48_000)
        return m
    robot.bad_image['front'] = padded
    mark = len(robot.log())
    expect_log(robot, mark, r'camera front: image of 48000 bytes is over max_image_bytes '
               r'\(40000\); image dropped')
    assert_alive_and_commanding(robot, INPUTS)


def test_a_tiff_bomb_is_refused_from_its_header(robot):
    # 18 kB of deflate that decodes to 3 MB: refused before OpenCV is asked to decode it.
    bomb = cv2.imencode('.tiff', np.zeros((1000, 1000, 3), np.uint8),
                        [cv2.IMWRITE_TIFF_COMPRESSION, 8])[1].tobytes()
    assert len(bomb) < BYTES

    def bad(m):
        m.format, m.data = 'rgb8; tiff compressed ', bomb
        return m
    mark = len(robot.log())
    robot.bad_image['wrist'] = bad
    expect_log(robot, mark, r'camera wrist: TIFF header says an image of 1000x1000 pixels is '
               r'over max_image_pixels \(10000\); image dropped')
    assert_alive_and_commanding(robot, INPUTS)


def test_made_up_encodings_do_not_grow_the_reporter(robot):
    before = robot.fresh_diag()
    rng = random.Random(0)

    def bad(m):
        m.encoding = ''.join(rng.choices(string.ascii_lowercase, k=10))
        return m
    mark = len(robot.log())
    robot.bad_image['front'] = bad
    t = time.monotonic()
    time.sleep(6.0)  # ~90 images, each with an encoding of its own
    seconds = time.monotonic() - t
    robot.bad_image.clear()
    lines = re.findall(r"camera front: unsupported image encoding '[a-z]+'",
                       log_after(robot, mark))
    assert lines, log_after(robot, mark)[-3000:]
    # Rate-limited as one problem: once per report_period (1 s), not once per encoding.
    assert len(lines) <= seconds / PARAMS['report_period'] + 2, len(lines)
    d = robot.fresh_diag()
    assert int(d['problem_kinds']) - int(before['problem_kinds']) <= 2, (before, d)
    # Each a made-up encoding of its own (fewer than the 90 sent on a loaded machine).
    assert int(d['dropped_images']) - int(before['dropped_images']) > 10
    assert_alive_and_commanding(robot, INPUTS)


def test_an_overlong_question_is_refused_before_tokenizing(robot):
    # Refused on their characters, so neither the spaces (5023 tokens of the built-in
    # tokenizer) nor a megabyte of text are tokenized first.
    spaced = 'is the cup ' + ' ' * 5000 + 'there?'
    for future, n in zip(robot.ask(spaced, 'x' * 10**6), (len(spaced), 10**6), strict=True):
        status, r = result(future)
        assert status == ABORTED and r.reason == Ask.Result.REJECTED, (r.reason, r.message)
        assert re.fullmatch(rf'the question takes {n + FORMAT_CHARS} characters '
                            r'with its format, over the \d+ taken for max_question_tokens 48 '
                            r'.*: refused before tokenizing', r.message), r.message
    (future,) = robot.ask('is the cup there?')
    status, r = result(future)
    assert status == SUCCEEDED, (r.reason, r.message)


def test_more_open_goals_than_the_cap_are_refused_with_the_reason(robot):
    mark = len(robot.log())
    robot.paused.add('front')  # no frame: the questions wait
    expect_log(robot, mark, r'no frame: front stale')
    futures = robot.ask(*[f'question {i}?' for i in range(OPEN + 1)])
    status, r = result(futures[-1], timeout=TIMEOUT_S / 2)
    assert status == ABORTED and r.reason == Ask.Result.REJECTED
    assert r.message == (f'{OPEN} questions are open, as many as max_open_questions allows: '
                         'ask again when one has ended')
    assert not any(f.done() for f in futures[:-1])
    robot.paused.clear()
    for f in futures[:-1]:
        result(f)  # answered or timed out: ended either way


def test_a_question_whose_frame_never_comes_times_out(robot):
    mark = len(robot.log())
    robot.paused.add('front')
    expect_log(robot, mark, r'no frame: front stale')
    t = time.monotonic()
    (future,) = robot.ask('anyone there?')
    status, r = result(future, timeout=TIMEOUT_S + 10)
    waited = time.monotonic() - t
    assert status == ABORTED and r.reason == Ask.Result.TIMEOUT == 'timeout', r.reason
    assert re.fullmatch(r'no frame came within 3 s \(question_timeout\): front stale \(\d+ ms '
                        r'old, limit 500 ms\)', r.message), r.message
    assert TIMEOUT_S - 0.2 <= waited <= TIMEOUT_S + 5, waited
    d = robot.fresh_diag()
    assert int(d['questions_timed_out']) >= 1 and d['questions_open'] == '0', d
    robot.paused.clear()
    assert_alive_and_commanding(robot, INPUTS)
    (future,) = robot.ask('and now?')
    status, r = result(future)
    assert status == SUCCEEDED, (r.reason, r.message)
