"""Bounded inputs without ROS: images over max_image_pixels / max_image_bytes refused from
their headers before anything is decoded (raw, JPEG, PNG, TIFF), TIFF directories read as
TIFF 6.0 lays them out (checked against what OpenCV decodes), the Reporter's keys bounded,
and ~/ask: an overlong question refused before tokenizing, open goals capped, questions
whose frame does not come ending with reason timeout."""
import struct
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

cv2 = pytest.importorskip('cv2')

from oxygen_ros.engine import Engine, EngineConfig  # noqa: E402
from oxygen_ros.engine.ask import TIMEOUT, WAITING, Asks, Goal, Result  # noqa: E402
from oxygen_ros.model import Pi05, load_config  # noqa: E402
from oxygen_ros.model.tokenizer import Tokenizer  # noqa: E402
from oxygen_ros.robot import images  # noqa: E402
from oxygen_ros.robot.images import image_problem  # noqa: E402
from oxygen_ros.robot.report import Reporter  # noqa: E402

torch.set_num_threads(1)
TIFF = 'rgb8; tiff compressed '


def tiff(order, w, h, spp=3, bits=8, extra=()):
    """An uncompressed TIFF written from the TIFF 6.0 layout (not by OpenCV): header, pixel
    data, then one directory; `extra` adds (tag, type, values) entries."""
    e = '<' if order == 'II' else '>'
    pixels = bytes(w * h * spp * bits // 8)
    data_at = 8
    ifd_at = data_at + len(pixels)
    ifd_at += ifd_at % 2
    entries = [(256, 4, [w]), (257, 4, [h]), (258, 3, [bits] * spp), (259, 3, [1]),
               (262, 3, [2 if spp >= 3 else 1]), (273, 4, [data_at]), (277, 3, [spp]),
               (278, 4, [h]), (279, 4, [len(pixels)]), *extra]
    entries.sort()
    out_of_line = b''
    body = b''
    after = ifd_at + 2 + 12 * len(entries) + 4
    for tag, kind, values in entries:
        fmt = {3: 'H', 4: 'I'}[kind]
        packed = struct.pack(e + fmt * len(values), *values)
        if len(packed) <= 4:
            body += struct.pack(e + 'HHI', tag, kind, len(values)) + packed.ljust(4, b'\0')
        else:
            body += struct.pack(e + 'HHII', tag, kind, len(values), after + len(out_of_line))
            out_of_line += packed
    head = order.encode() + struct.pack(e + 'HI', 42, ifd_at)
    return (head + pixels).ljust(ifd_at, b'\0') + struct.pack(e + 'H', len(entries)) + body \
        + b'\0\0\0\0' + out_of_line


@pytest.mark.parametrize('order', ['II', 'MM'])
@pytest.mark.parametrize('w,h,spp,bits', [(7, 5, 3, 8), (64, 48, 1, 8), (33, 17, 4, 16),
                                          (300, 2, 3, 16)])
def test_tiff_header_gives_what_opencv_decodes(order, w, h, spp, bits):
    data = tiff(order, w, h, spp, bits)
    px = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    assert px is not None and px.shape[:2] == (h, w)
    assert images.header_size('tiff', data) == (w, h, spp * bits // 8)
    # OpenCV's own TIFF writer too.
    enc = cv2.imencode('.tiff', np.zeros((h, w, 3), np.uint8))[1].tobytes()
    assert images.header_size('tiff', enc) == (w, h, 3)


class NoDecode:
    """Stands in for the decoder: a payload refused from its header never reaches it."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = images._imdecode

        def spy(data, via):
            self.calls += 1
            return real(data, via)
        monkeypatch.setattr(images, '_imdecode', spy)


def test_a_tiff_bomb_is_refused_from_its_header(monkeypatch):
    # 3000x3000 of zeros: a 27 MB image in a payload OpenCV squeezes to a few kB.
    bomb = cv2.imencode('.tiff', np.zeros((3000, 3000, 3), np.uint8))[1].tobytes()
    assert len(bomb) < 500_000
    spy = NoDecode(monkeypatch)
    with pytest.raises(ValueError, match=r'^TIFF header says an image of 3000x3000 pixels is '
                       r'over max_image_pixels \(1000000\)$'):
        images.decode(TIFF, bomb, 'cv2', max_pixels=1_000_000)
    with pytest.raises(ValueError, match=r'^TIFF header says an image of 27000000 bytes is '
                       r'over max_image_bytes \(1000000\)$'):
        images.Camera('cv2', 10**8, 1_000_000).decode(TIFF, bomb)
    assert spy.calls == 0
    assert images.decode(TIFF, tiff('II', 64, 48), 'cv2').shape == (48, 64, 3)
    assert spy.calls == 1


@pytest.mark.parametrize('why,data,message', [
    ('a directory past the end', b'II*\0' + struct.pack('<I', 10**6), r'runs past the'),
    ('no width', tiff('II', 4, 4)[:8] + tiff('II', 4, 4)[8:].replace(
        struct.pack('<HHI', 256, 4, 1), struct.pack('<HHI', 999, 4, 1)), r'without ImageWidth'),
    ('width twice', tiff('MM', 4, 4, extra=[(256, 4, [5])]), r'gives tag 256 twice'),
    ('five samples a pixel', tiff('II', 4, 4, spp=5), r'5 samples per pixel'),
    ('32-bit samples', tiff('II', 4, 4, spp=1, bits=32), r'of 32 bits'),
    ('a width of 5 values', tiff('II', 4, 4, extra=[(256, 4, [1] * 5)]), r'5 values'),
])
def test_unreadable_tiff_headers_are_refused(why, data, message, monkeypatch):
    spy = NoDecode(monkeypatch)
    with pytest.raises(ValueError, match=message):
        images.decode(TIFF, data, 'cv2')
    assert spy.calls == 0


def test_a_camera_refuses_another_tiff_size_from_the_header(monkeypatch):
    cam = images.Camera('cv2')
    assert cam.decode(TIFF, tiff('II', 64, 48)).shape == (48, 64, 3)
    spy = NoDecode(monkeypatch)
    with pytest.raises(ValueError, match='^65x48 image, but this camera sent 64x48 before'):
        cam.decode(TIFF, tiff('II', 65, 48))
    assert spy.calls == 0


def test_payload_and_decoded_bytes_are_capped(monkeypatch):
    px16 = np.zeros((100, 100, 4), np.uint16)
    png16 = cv2.imencode('.png', px16)[1].tobytes()
    spy = NoDecode(monkeypatch)
    # 100x100 of 4 16-bit values decodes to 80000 bytes.
    with pytest.raises(ValueError, match=r'^PNG header says an image of 80000 bytes is over '
                       r'max_image_bytes \(79999\)$'):
        images.decode('rgba16; png compressed bgr16', png16, 'cv2', max_bytes=79_999)
    jpeg = cv2.imencode('.jpg', np.zeros((100, 100, 3), np.uint8))[1].tobytes()
    with pytest.raises(ValueError, match=rf'^JPEG payload of {len(jpeg)} bytes is over '
                       r'max_image_bytes \(100\)$'):
        images.Camera('cv2', max_bytes=100).decode('rgb8; jpeg compressed bgr8', jpeg)
    with pytest.raises(ValueError, match=r'^JPEG header says an image of 100x100 pixels is '
                       r'over max_image_pixels \(9999\)$'):
        images.decode('rgb8; jpeg compressed bgr8', jpeg, 'cv2', max_pixels=9999)
    # Thousands of scans, each decoded over the whole image.
    scans = jpeg[:-2] + b'\xff\xda\x00\x02' * (images.MAX_SCANS + 1) + b'\xff\xd9'
    with pytest.raises(ValueError, match=rf'^JPEG of {images.MAX_SCANS + 2} scans'):  # and its own
        images.decode('rgb8; jpeg compressed bgr8', scans, 'cv2')
    assert spy.calls == 0
    assert images.decode('rgb8; jpeg compressed bgr8', jpeg, 'cv2', 10_000, 30_000).shape == (
        100, 100, 3)


def test_a_png_chunk_longer_than_the_payload_is_refused_before_decoding(monkeypatch):
    # OpenCV 4.11 allocated the 3 GB this IDAT's length says (and took seconds) before it
    # found the payload shorter; what the fuzzer found, IHDR and all.
    png = cv2.imencode('.png', np.zeros((27, 9, 3), np.uint8))[1].tobytes()
    i = 8 + 12 + 13  # after the signature and IHDR: the first IDAT
    assert png[i + 4:i + 8] == b'IDAT'
    bomb = png[:i] + (3_003_122_431).to_bytes(4, 'big') + png[i + 4:]
    spy = NoDecode(monkeypatch)
    with pytest.raises(ValueError, match=rf'^PNG chunk at byte {i} says 3003122431 bytes, past '
                       rf'the end of the {len(png)}-byte payload$'):
        images.decode('rgb8; png compressed bgr8', bomb, 'cv2')
    many = png[:i] + b'\0\0\0\0tEXt\0\0\0\0' * (images.MAX_CHUNKS + 1) + png[i:]
    with pytest.raises(ValueError, match=rf'^PNG of more than {images.MAX_CHUNKS} chunks$'):
        images.decode('rgb8; png compressed bgr8', many, 'cv2')
    assert spy.calls == 0
    assert images.decode('rgb8; png compressed bgr8', png, 'cv2').shape == (27, 9, 3)


def test_raw_images_are_capped_before_converting():
    def msg(w, h, step=None, extra=0):
        step = step or w * 3
        return SimpleNamespace(encoding='rgb8', width=w, height=h, step=step,
                               data=bytes(step * h + extra))
    assert image_problem(msg(100, 100), 10_000, 30_000) is None
    assert image_problem(msg(101, 100), 10_000, 10**6) == (
        'image of 101x100 pixels is over max_image_pixels (10000)')
    assert image_problem(msg(100, 100, extra=1), 10_000, 30_000) == (
        'image of 30001 bytes is over max_image_bytes (30000)')
    # A header of 4 billion pixels on a small buffer: refused for its size, nothing made.
    assert 'over max_image_pixels' in image_problem(msg(2**16, 2**16, step=1), 10**6, 10**6)


def test_reporter_keys_past_the_cap_fold_into_other():
    said = []
    r = Reporter(said.append, period=100.0, clock=lambda: 0.0, max_keys=4)
    for i in range(1000):
        r.report(f'image:cam:kind {i}', f'problem {i}')
    assert set(r.totals) == {'image:cam:kind 0', 'image:cam:kind 1', 'image:cam:kind 2',
                             'image:cam:kind 3', 'image:other'}
    assert r.totals['image:other'] == 996 and r.count('image:') == 1000
    # The rate limit holds: one message per key in the period, however many came.
    assert len(said) == 5


# -- ~/ask -------------------------------------------------------------------------------

@pytest.fixture(scope='module')
def engine():
    torch.manual_seed(0)
    model = Pi05(load_config('tiny')).to_inference('cpu')
    cfg = EngineConfig(model='tiny', compile=False, decode_k=1, max_requests=2, max_new_tokens=5,
                       prompt_format='subtask', max_question_tokens=48)
    return Engine(cfg, model=model, tokenizer=Tokenizer.default())


def test_an_overlong_question_is_refused_before_tokenizing(engine, monkeypatch):
    tok = engine.tokenizer
    longest = max(len(tok._sp.id_to_piece(i)) for i in range(tok.vocab_size))
    assert tok.longest_piece == longest
    calls = []
    real = tok.encode
    monkeypatch.setattr(tok, 'encode', lambda *a, **k: calls.append(a) or real(*a, **k))
    most = 48 * longest
    # A run of spaces the tokenizer would squeeze into a few tokens: refused all the same.
    for question in ('x' * 10**7, 'is it ' + ' ' * most + 'there?'):
        with pytest.raises(ValueError, match=rf'^the question takes \d+ characters with its '
                           rf'format, over the {most} taken for max_question_tokens 48 .*'
                           'refused before tokenizing$'):
            engine.ask(question)
    assert calls == []
    rid = engine.ask('is the cup in the gripper?')
    assert rid > 0 and len(calls) == 1
    assert engine.withdraw(rid) and not engine.withdraw(rid)


class Inbox:
    """An engine whose questions wait for a frame that never comes."""

    def __init__(self):
        self.waiting, self.next_id = set(), 1

    def ask(self, question, max_new_tokens, prompt_format):
        self.next_id += 1
        self.waiting.add(self.next_id)
        return self.next_id

    def withdraw(self, rid):
        if rid in self.waiting:
            self.waiting.discard(rid)
            return True
        return False


def test_open_goals_are_capped_and_waiting_ones_time_out():
    e = Inbox()
    asks = Asks(max_open=3, timeout=2.0)
    asks.activate(e)
    t = time.monotonic()
    open_ = [asks.open(Goal(f'q{i}?')) for i in range(3)]
    refused = asks.open(Goal('one more?'))
    r = refused.next(0)
    assert isinstance(r, Result) and r.reason == 'rejected'
    assert r.message == ('3 questions are open, as many as max_open_questions allows: ask '
                         'again when one has ended')
    # One was taken by a frame meanwhile (withdraw fails): it is not timed out.
    e.waiting.discard(open_[2].request_id)
    assert asks.expire(t + 1.9, 'front stale') == 0
    assert asks.expire(t + 2.5, 'front stale (600 ms old, limit 500 ms)') == 2
    for a in open_[:2]:
        items = [a.next(0), a.next(0)]
        assert items[0].state == WAITING
        assert (items[1].reason, items[1].message) == (
            TIMEOUT, 'no frame came within 2 s (question_timeout): front stale (600 ms old, '
            'limit 500 ms)')
    assert open_[2].result is None and asks.open_count == 1
    s = asks.stats()
    assert (s['questions_timed_out'], s['questions_rejected'], s['questions_open']) == (2, 1, 1)
    assert asks.open(Goal('room again?')).result is None
