"""Compressed camera images (sensor_msgs/CompressedImage as image_transport's compressed
plugin publishes them) decoded to the RGB the raw path gives, and bad payloads refused.

The format strings below are written out by hand from compressed_publisher.cpp
(ros-perception/image_transport_plugins at 7404d772b66f), not taken from oxygen_ros, so a
wrong string in images.encode fails here. References: the raw path (images.image_to_rgb on
the same image as a raw message) and an independent decode (cv2.imdecode and numpy).
Every decode runs through cv2 and, where installed, through cv_bridge.
"""
from types import SimpleNamespace

import numpy as np
import pytest

cv2 = pytest.importorskip('cv2')

from oxygen_ros.robot import contract, images  # noqa: E402
from oxygen_ros.robot.contract import Config  # noqa: E402
from oxygen_ros.robot.params import StartError  # noqa: E402
from oxygen_ros.sim.scene import render  # noqa: E402

NO_BRIDGE = ('cv_bridge is not installed (tools/ws.sh builds it when OXYGEN_CV_BRIDGE_SRC '
             'names cv_bridge-src.tar.gz; .ci/run passes ../shared/ros-overlay/)')
needs_bridge = pytest.mark.skipif(images.bridge() is None, reason=NO_BRIDGE)
VIAS = ['cv2', pytest.param('cv_bridge', marks=needs_bridge)]
W, H = 320, 240
SCENE = render(W, H, seed=3)
GREY = cv2.cvtColor(SCENE, cv2.COLOR_RGB2GRAY)


def raw(encoding, px):
    """A raw sensor_msgs/Image-like message of `px` (what the raw path takes)."""
    channels = 1 if px.ndim == 2 else px.shape[2]
    return SimpleNamespace(encoding=encoding, height=px.shape[0], width=px.shape[1],
                           step=px.shape[1] * channels * px.itemsize, is_bigendian=0,
                           data=np.ascontiguousarray(px).tobytes())


def pixels(encoding):
    """The scene in `encoding` (8-bit)."""
    rgb = SCENE
    alpha = np.full((H, W, 1), 200, np.uint8)
    return {'rgb8': rgb, 'bgr8': rgb[:, :, ::-1], 'rgba8': np.concatenate([rgb, alpha], 2),
            'bgra8': np.concatenate([rgb[:, :, ::-1], alpha], 2), 'mono8': GREY}[encoding]


def pixels16(encoding):
    """The scene as 16 bits, with low bits that 8-bit rounding must get right."""
    base = SCENE if encoding != 'mono16' else GREY
    v = base.astype(np.uint16) * 257
    v = v + np.random.default_rng(1).integers(-128, 128, v.shape).clip(-v, 65535 - v)
    v = v.astype(np.uint16)
    return v[:, :, ::-1].copy() if encoding == 'bgr16' else v


FORMATS_8 = {  # encoding -> (jpeg format, png format), exactly as the publisher writes them
    'rgb8': ('rgb8; jpeg compressed bgr8', 'rgb8; png compressed bgr8'),
    'bgr8': ('bgr8; jpeg compressed bgr8', 'bgr8; png compressed bgr8'),
    'rgba8': ('rgba8; jpeg compressed bgr8', 'rgba8; png compressed bgr8'),
    'bgra8': ('bgra8; jpeg compressed bgr8', 'bgra8; png compressed bgr8'),
    'mono8': ('mono8; jpeg compressed mono8', 'mono8; png compressed '),
}


@pytest.mark.parametrize('via', VIAS)
@pytest.mark.parametrize('encoding', list(FORMATS_8))
def test_png_gives_exactly_the_raw_path(encoding, via):
    px = pixels(encoding)
    fmt, data = images.encode(px, encoding, 'png', 3)
    assert fmt == FORMATS_8[encoding][1]
    assert data[:8] == b'\x89PNG\r\n\x1a\n'
    out = images.decode(fmt, data, via)
    assert out.dtype == np.uint8 and out.shape == (H, W, 3) and out.flags.c_contiguous
    np.testing.assert_array_equal(out, images.image_to_rgb(raw(encoding, px)))


# Measured on the scene above at 320x240 (libjpeg-turbo in opencv-python-headless 4.11):
# colour q95: mean 1.95, 99.9th percentile 48, max 81 (4:2:0 chroma at saturated edges);
# q80: 2.31 / 50 / 89; mono q95: 0.89 / 4 / 7, q80: 1.21 / 12 / 26. Bounds just above.
JPEG_BOUNDS = {('colour', 95): (2.1, 52, 90), ('colour', 80): (2.5, 55, 96),
               ('mono', 95): (1.0, 5, 9), ('mono', 80): (1.35, 14, 30)}


def jpeg_error(out, ref):
    e = np.abs(out.astype(int) - ref.astype(int))
    return e.mean(), np.percentile(e, 99.9), e.max()


@pytest.mark.parametrize('via', VIAS)
@pytest.mark.parametrize('quality', [80, 95])
@pytest.mark.parametrize('encoding', list(FORMATS_8))
def test_jpeg_gives_the_raw_path_within_jpeg_error(encoding, quality, via):
    px = pixels(encoding)
    fmt, data = images.encode(px, encoding, 'jpeg', quality)
    assert fmt == FORMATS_8[encoding][0]
    out = images.decode(fmt, data, via)
    assert out.dtype == np.uint8 and out.shape == (H, W, 3)
    # Exactly what decoding the JPEG gives, put in RGB order by hand.
    plain = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    by_hand = np.repeat(plain[:, :, None], 3, 2) if encoding == 'mono8' else plain[:, :, ::-1]
    np.testing.assert_array_equal(out, by_hand)
    ref = images.image_to_rgb(raw(encoding, px))
    mean, p999, top = jpeg_error(out, ref)
    bound = JPEG_BOUNDS[('mono' if encoding == 'mono8' else 'colour', quality)]
    assert mean <= bound[0] and p999 <= bound[1] and top <= bound[2], (mean, p999, top)
    if encoding != 'mono8':
        # The bound tells the channel order apart: red and blue swapped is far outside it.
        assert jpeg_error(out[:, :, ::-1], ref)[0] > 5 * bound[0]


@pytest.mark.parametrize('via', VIAS)
@pytest.mark.parametrize('encoding', ['rgb16', 'bgr16', 'mono16'])
def test_16bit_png_scales_as_cv_bridge_does(encoding, via):
    px = pixels16(encoding)
    if encoding == 'mono16':
        fmt, target = 'mono16; png compressed ', px
    else:
        fmt = f'{encoding}; png compressed bgr16'
        target = px[:, :, ::-1] if encoding == 'rgb16' else px
    ok, data = cv2.imencode('.png', np.ascontiguousarray(target))
    out = images.decode(fmt, data.tobytes(), via)
    # 16 -> 8 bits: x * 255 / 65535 to the nearest, in float64 here.
    as_rgb = px if encoding != 'bgr16' else px[:, :, ::-1]
    want = np.round(as_rgb.astype(np.float64) * 255 / 65535).astype(np.uint8)
    if encoding == 'mono16':
        want = np.repeat(want[:, :, None], 3, 2)
    np.testing.assert_array_equal(out, want)
    if images.bridge() is not None:  # the raw path converts 16 bits only through cv_bridge
        np.testing.assert_array_equal(out, images.image_to_rgb(raw(encoding, px)))


@pytest.mark.parametrize('via', VIAS)
def test_16bit_colour_jpeg(via):
    # The publisher makes 8-bit BGR of a 16-bit colour image before compressing it.
    px = pixels16('rgb16')
    bgr8 = np.round(px[:, :, ::-1] * (255 / 65535)).astype(np.uint8)
    ok, data = cv2.imencode('.jpg', bgr8, [cv2.IMWRITE_JPEG_QUALITY, 95])
    out = images.decode('rgb16; jpeg compressed bgr8', data.tobytes(), via)
    mean, p999, top = jpeg_error(out, bgr8[:, :, ::-1])
    assert mean <= 2.1 and p999 <= 52 and top <= 90, (mean, p999, top)


@pytest.mark.parametrize('via', VIAS)
@pytest.mark.parametrize('codec', ['jpeg', 'png'])
def test_older_plain_formats(codec, via):
    # Before the format said more: 3 channels are BGR, 1 is mono.
    ext = '.jpg' if codec == 'jpeg' else '.png'
    colour = cv2.imencode(ext, SCENE[:, :, ::-1].copy())[1].tobytes()
    grey = cv2.imencode(ext, GREY)[1].tobytes()
    out, out_grey = images.decode(codec, colour, via), images.decode(codec, grey, via)
    if codec == 'png':
        np.testing.assert_array_equal(out, SCENE)
        np.testing.assert_array_equal(out_grey, np.repeat(GREY[:, :, None], 3, 2))
    else:
        assert jpeg_error(out, SCENE)[0] <= 2.1
        assert jpeg_error(out_grey, np.repeat(GREY[:, :, None], 3, 2))[0] <= 1.0


@pytest.mark.parametrize('via', VIAS)
@pytest.mark.parametrize('encoding', ['rgb8', 'bgra8', 'mono8', 'mono16'])
def test_tiff_is_the_raw_image_as_it_was(encoding, via):
    px = pixels16(encoding) if encoding == 'mono16' else pixels(encoding)
    ok, data = cv2.imencode('.tiff', np.ascontiguousarray(px))
    out = images.decode(f'{encoding}; tiff compressed ', data.tobytes(), via)
    if encoding == 'mono16':
        want = np.round(px.astype(np.float64) * 255 / 65535).astype(np.uint8)
        np.testing.assert_array_equal(out, np.repeat(want[:, :, None], 3, 2))
    else:
        np.testing.assert_array_equal(out, images.image_to_rgb(raw(encoding, px)))


@needs_bridge
def test_bayer_png_is_demosaiced_as_the_raw_path_does():
    mosaic = np.random.default_rng(2).integers(0, 256, (H, W), dtype=np.uint8)
    data = cv2.imencode('.png', mosaic)[1].tobytes()
    out = images.decode('bayer_rggb8; png compressed ', data)
    np.testing.assert_array_equal(out, images.image_to_rgb(raw('bayer_rggb8', mosaic)))


def test_auto_decodes_through_cv_bridge_where_installed(monkeypatch):
    calls = []

    class Spy:
        def compressed_imgmsg_to_cv2(self, msg, desired):
            calls.append(desired)
            return cv2.imdecode(np.frombuffer(msg.data, np.uint8), cv2.IMREAD_UNCHANGED)

    fmt, data = images.encode(pixels('rgb8'), 'rgb8', 'png', 3)
    monkeypatch.setattr(images, '_bridge', Spy())
    monkeypatch.setattr(images, '_bridge_checked', True)
    np.testing.assert_array_equal(images.decode(fmt, data), SCENE)
    assert calls == ['passthrough']
    monkeypatch.setattr(images, '_bridge', None)
    np.testing.assert_array_equal(images.decode(fmt, data), SCENE)  # cv2 then
    assert calls == ['passthrough']


JPEG = cv2.imencode('.jpg', SCENE[:, :, ::-1].copy(), [cv2.IMWRITE_JPEG_QUALITY, 90])[1].tobytes()
PNG = cv2.imencode('.png', SCENE[:, :, ::-1].copy())[1].tobytes()
GREY_JPEG = cv2.imencode('.jpg', GREY)[1].tobytes()


def flipped(data, start, n):
    b = bytearray(data)
    for i in range(start, start + n):
        b[i] ^= 0xFF
    return bytes(b)


def segment(data, marker):
    """Where the first segment with `marker` starts in a JPEG."""
    i = 2
    while data[i + 1] != marker:
        i += 2 + int.from_bytes(data[i + 2:i + 4], 'big')
    return i


def huge_png():
    b = bytearray(PNG)
    b[16:24] = (100_000).to_bytes(4, 'big') * 2
    return bytes(b)


C = 'rgb8; jpeg compressed bgr8'
P = 'rgb8; png compressed bgr8'
BAD = [
    ('empty jpeg', C, b'', r'^empty jpeg payload$'),
    ('empty png', P, b'', r'^empty png payload$'),
    ('jpeg cut in half', C, JPEG[:len(JPEG) // 2], r'JPEG has no end-of-image marker: cut short'),
    ('jpeg without its last bytes', C, JPEG[:-2], r'no end-of-image marker'),
    ('jpeg cut to its first bytes', C, JPEG[:3], r'no end-of-image marker'),
    ('png cut in half', P, PNG[:len(PNG) // 2], r'PNG has no IEND chunk at its end: cut short'),
    ('jpeg header overwritten', C, JPEG[:20] + bytes(40) + JPEG[60:],
     r'JPEG without a readable frame header|corrupt: it does not decode'),
    # JPEG has no checksum: bytes flipped inside the scan data decode to a wrong image
    # without an error (libjpeg only warns), so only broken structure is refused.
    ('jpeg Huffman table overwritten', C, flipped(JPEG, segment(JPEG, 0xC4) + 4, 20),
     r'JPEG is corrupt: it does not decode'),
    ('jpeg quantisation table overwritten', C, flipped(JPEG, segment(JPEG, 0xDB) + 4, 60),
     r'JPEG is corrupt: it does not decode'),
    ('jpeg frame header overwritten', C, flipped(JPEG, segment(JPEG, 0xC0) + 4, 6),
     r'JPEG header says|JPEG is corrupt|decoded \d+x\d+, its header says'),
    ('png data flipped', P, flipped(PNG, len(PNG) // 2, 1), r'PNG is corrupt: it does not decode'),
    ('png labelled jpeg', C, PNG, r'the format says jpeg but the \d+-byte payload is a PNG'),
    ('jpeg labelled png', P, JPEG, r'the format says png but the \d+-byte payload is a JPEG'),
    ('text labelled jpeg', C, b'hello world', r'is not a JPEG \(it starts 68656c6c\)'),
    ('grey jpeg labelled colour', C, GREY_JPEG,
     r"format 'rgb8; jpeg compressed bgr8' but the JPEG decodes to 1 channel\(s\) of uint8, "
     r'not 3 of 8-bit values'),
    ('colour jpeg labelled mono8', 'mono8; jpeg compressed mono8', JPEG,
     r'decodes to 3 channel\(s\) of uint8, not 1'),
    ('8-bit png labelled bgr16', 'rgb16; png compressed bgr16', PNG,
     r'decodes to 3 channel\(s\) of uint8, not 3 of 16-bit values'),
    ('depth png', '16UC1; compressedDepth png', PNG, r'compressed depth image .* not colour'),
    ('depth rvl', '32FC1; compressedDepth rvl', b'\x00' * 64, r'compressed depth image'),
    ('depth, older format', '16UC1; compressedDepth', PNG, r'compressed depth image'),
    ('depth as mono jpeg', '16UC1; jpeg compressed mono8', GREY_JPEG,
     r'16UC1 is a depth or single-value image, not colour'),
    ('another transport', 'h264', JPEG, r"unknown compressed image format 'h264'"),
    ('another codec', 'rgb8; webp compressed bgr8', JPEG, r'unknown compressed image format'),
    ('a target image_transport never writes', 'rgb8; jpeg compressed rgb8', JPEG,
     r"image_transport writes jpeg as 'bgr8' or 'mono8', not 'rgb8'"),
    ('unknown encoding', 'foo8; jpeg compressed bgr8', JPEG, r"unknown image encoding 'foo8'"),
    ('mono labelled colour target', 'mono8; jpeg compressed bgr8', JPEG,
     r"a mono8 image is not compressed as 'bgr8'"),
    ('a header of 100000x100000', P, huge_png(),
     r'PNG header says an image of 100000x100000 pixels is over max_image_pixels'),
]


@pytest.mark.parametrize('via', VIAS)
@pytest.mark.parametrize('fmt,data,why', [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_payloads_are_refused(fmt, data, why, via):
    with pytest.raises(ValueError, match=why):
        images.decode(fmt, data, via)


def test_a_camera_keeps_its_first_size():
    cam = images.Camera('cv2')
    fmt, data = images.encode(SCENE, 'rgb8', 'jpeg', 90)
    assert cam.decode(fmt, data).shape == (H, W, 3)
    assert cam.size == (W, H)
    small = cv2.resize(SCENE, (W // 2, H // 2))
    for codec in ('jpeg', 'png'):
        f, d = images.encode(small, 'rgb8', codec, 90 if codec == 'jpeg' else 3)
        with pytest.raises(ValueError, match=rf'^160x120 image, but this camera sent {W}x{H} '
                           r'before \(reconfigure the node to take a new resolution\)$'):
            cam.decode(f, d)
        assert images.decode(f, d).shape == (H // 2, W // 2, 3)  # fine on its own
    # A tiff's size is known once decoded only; refused all the same.
    tiff = cv2.imencode('.tiff', small)[1].tobytes()
    with pytest.raises(ValueError, match='160x120 image, but this camera sent'):
        cam.decode('rgb8; tiff compressed ', tiff)
    assert cam.decode(fmt, data).shape == (H, W, 3)  # and the right size still decodes


def test_header_size_reads_jpeg_and_png_headers():
    for w, h in ((64, 48), (640, 480), (1280, 720)):
        img = cv2.resize(SCENE, (w, h))
        # (width, height, bytes a decoded pixel takes: 3 of 8 bits)
        assert images.header_size('jpeg', cv2.imencode('.jpg', img)[1].tobytes()) == (w, h, 3)
        assert images.header_size('png', cv2.imencode('.png', img)[1].tobytes()) == (w, h, 3)
        progressive = cv2.imencode('.jpg', img, [cv2.IMWRITE_JPEG_PROGRESSIVE, 1])[1].tobytes()
        assert images.header_size('jpeg', progressive) == (w, h, 3)
        grey16 = cv2.imencode('.png', np.zeros((h, w), np.uint16))[1].tobytes()
        assert images.header_size('png', grey16) == (w, h, 2)


# -- camera_transports -----------------------------------------------------------------------

ROBOT = dict(cameras=['front', 'wrist'], camera_slots=['base_0_rgb', 'left_wrist_0_rgb'],
             joints=['a', 'b'], output_groups=['arm'], **{'outputs.arm.topic': 'arm/cmd',
                                                           'outputs.arm.joints': ['a', 'b'],
                                                           'outputs.arm.indices': [0, 1]})


def test_transports_default_to_raw_and_follow_the_topics():
    c = Config.from_values(ROBOT)
    assert c.transports == {'front': 'raw', 'wrist': 'raw'}
    assert c.cameras == {'front': 'front/image_raw', 'wrist': 'wrist/image_raw'}
    c = Config.from_values(dict(ROBOT, camera_topics=['front/image_raw/compressed', 'w/img']))
    assert c.transports == {'front': 'compressed', 'wrist': 'raw'}
    assert c.cameras == {'front': 'front/image_raw/compressed', 'wrist': 'w/img'}


def test_compressed_transport_reads_the_compressed_topic():
    c = Config.from_values(dict(ROBOT, camera_transports=['compressed', 'raw']))
    assert c.transports == {'front': 'compressed', 'wrist': 'raw'}
    assert c.cameras == {'front': 'front/image_raw/compressed', 'wrist': 'wrist/image_raw'}
    c = Config.from_values(dict(ROBOT, camera_transports=['compressed', 'compressed'],
                                camera_topics=['f/compressed', '/abs/wrist']))
    assert c.cameras == {'front': 'f/compressed', 'wrist': '/abs/wrist/compressed'}


@pytest.mark.parametrize('values,message', [
    (dict(camera_transports=['raw', 'raw'], camera_topics=['f/image/compressed', 'w']),
     "camera_transports says raw for camera front, but its topic 'f/image/compressed' ends in "
     '/compressed'),
    (dict(camera_transports=['compressed']), 'camera_transports names 1 transports for 2 '
     'cameras'),
    (dict(camera_transports=['raw', 'jpeg']), "parameter camera_transports must be one of raw, "
     "compressed, got 'jpeg'"),
])
def test_bad_transports_are_configure_errors(values, message):
    with pytest.raises(StartError, match=message):
        Config.from_values(dict(ROBOT, **values))


def test_without_opencv_a_compressed_camera_is_refused(monkeypatch):
    monkeypatch.setattr(images, 'unavailable', lambda: 'decoding it needs OpenCV (cv2)')
    with pytest.raises(StartError, match=r'^camera wrist is compressed, but decoding it needs '
                       r'OpenCV \(cv2\)$'):
        Config.from_values(dict(ROBOT, camera_transports=['raw', 'compressed']))
    Config.from_values(ROBOT)  # raw cameras need nothing
    assert contract.compressed_topic('a/compressed/') and not contract.compressed_topic('a/b')
