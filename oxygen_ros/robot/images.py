"""Camera images to RGB: raw (sensor_msgs/Image) and compressed (sensor_msgs/CompressedImage).

Raw images of the five built-in encodings are converted here; the other colour encodings
(16-bit, YUV 4:2:2, Bayer) through cv_bridge where it is installed. Depth, disparity and
masks have no colour meaning and are refused.

Camera images that come compressed (sensor_msgs/CompressedImage), decoded to RGB.

image_transport's compressed plugin (ros-perception/image_transport_plugins,
compressed_image_transport/src/compressed_publisher.cpp; read at commit 7404d772b66f, the
rolling branch Jazzy's 4.0 release was cut from) publishes `<topic>/compressed` with
`format` = the raw image's encoding, then what it compressed:

    <encoding>; jpeg compressed bgr8    colour images (8 or 16 bit), as 8-bit BGR
    <encoding>; jpeg compressed mono8   everything else with 8 or 16 bits (mono, Bayer, YUV)
    <encoding>; png compressed bgr8     8-bit colour (rgba8/bgra8 lose alpha)
    <encoding>; png compressed bgr16    16-bit colour
    <encoding>; png compressed          (trailing space) not colour: kept as it is, 8 or 16 bit
    <encoding>; tiff compressed         the raw image as it is
    jpeg / png                          older versions: 3 channels are BGR, 1 is mono

compressed_depth_image_transport writes `<encoding>; compressedDepth [png|rvl]`: depth, not
colour, refused like a raw 16UC1 image. Everything else is refused too, and so is a payload
that is empty, not what its format says, cut short, corrupt, or of another size than the
camera sent before: decoding errors must not become a wrong image.

cv_bridge's compressed_imgmsg_to_cv2 decodes where cv_bridge is installed, else OpenCV's
cv2.imdecode (what cv_bridge calls itself); with neither, compressed cameras are refused at
configure. Nothing here imports ROS.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

# Channels per supported encoding, and how to reach RGB from it.
ENCODINGS = {'rgb8': 3, 'bgr8': 3, 'rgba8': 4, 'bgra8': 4, 'mono8': 1}


# Bytes per pixel of the colour encodings only cv_bridge converts to RGB (its
# getConversionCodes: 16-bit colour and mono, YUV 4:2:2, Bayer); 16-bit values scale to 8.
BRIDGE_ENCODINGS = {
    'rgb16': 6, 'bgr16': 6, 'rgba16': 8, 'bgra16': 8, 'mono16': 2,
    'yuv422': 2, 'yuv422_yuy2': 2,
    **{f'bayer_{p}8': 1 for p in ('rggb', 'bggr', 'gbrg', 'grbg')},
    **{f'bayer_{p}16': 2 for p in ('rggb', 'bggr', 'gbrg', 'grbg')},
}
# Where both paths convert, the built-in one is used for these (a 640x480 rgb8 frame: 0.02 ms
# against cv_bridge's 0.7; bgr8 the same 0.7 ms either way); cv_bridge's OpenCV code is ~10x
# faster for rgba8, bgra8 and mono8. Measured by benchmarks/image_conversion.py.
BUILT_IN_FIRST = ('rgb8', 'bgr8')
# sensor_msgs generic types: depth, disparity, masks. Neither path gives them a colour meaning.
NOT_COLOUR = re.compile(r'(8|16|32|64)[USF]C[1-4]')


def _unsupported(encoding: str, bridged: bool) -> str:
    built_in = ', '.join(ENCODINGS)
    if NOT_COLOUR.fullmatch(encoding):
        return (f'unsupported image encoding {encoding!r}: a depth or single-value image, not '
                f'colour; neither the built-in conversion nor cv_bridge makes RGB of it')
    if encoding in BRIDGE_ENCODINGS and not bridged:
        return (f'unsupported image encoding {encoding!r} without cv_bridge: cv_bridge would '
                f'convert it but is not installed; built in: {built_in}')
    more = ', '.join(BRIDGE_ENCODINGS)
    if bridged:
        return f'unsupported image encoding {encoding!r}; supported: {built_in}, {more}'
    return (f'unsupported image encoding {encoding!r}; supported: {built_in} (and with '
            f'cv_bridge: {more})')


# The largest image taken unless max_image_pixels / max_image_bytes say otherwise: a
# 4096x4096 camera, and 64 MiB (4096x4096 rgb8 is 48 MiB). A camera's messages are held for
# a frame and converted, so a bigger one costs memory and time on every image.
MAX_PIXELS = 4096 * 4096
MAX_BYTES = 1 << 26


def check_size(width: int, height: int, nbytes: int, max_pixels: int = MAX_PIXELS,
               max_bytes: int = MAX_BYTES, what: str = 'image') -> None:
    """ValueError when a `width` x `height` image of `nbytes` bytes is over the caps; checked
    before anything is converted or decoded."""
    if width * height > max_pixels:
        raise ValueError(f'{what} of {width}x{height} pixels is over max_image_pixels '
                         f'({max_pixels})')
    if nbytes > max_bytes:
        raise ValueError(f'{what} of {nbytes} bytes is over max_image_bytes ({max_bytes})')


def check_image(encoding: str, height: int, width: int, step: int, size: int,
                bridged: bool = False) -> int:
    """Raise ValueError unless the image header describes a buffer that converts to RGB (with
    cv_bridge's encodings too when `bridged`); returns the bytes per pixel. Cheap enough to
    run in a subscription callback."""
    pixel = ENCODINGS.get(encoding) or (BRIDGE_ENCODINGS.get(encoding) if bridged else None)
    if pixel is None:
        raise ValueError(_unsupported(encoding, bridged))
    if height <= 0 or width <= 0:
        raise ValueError(f'image has no pixels ({width}x{height})')
    if step < width * pixel:
        raise ValueError(
            f'image step {step} is shorter than a {width}-pixel {encoding} row '
            f'({width * pixel} bytes)'
        )
    if size < step * (height - 1) + width * pixel:
        raise ValueError(
            f'image data has {size} bytes, a {width}x{height} {encoding} image with step '
            f'{step} needs {step * height}'
        )
    return pixel


def check_bridged(encoding: str, height: int, width: int, step: int, size: int) -> None:
    """What cv_bridge's imgmsg_to_cv2 also needs, beyond check_image: it views the buffer as
    whole pixels per row, so a step that is not a whole number of pixels would shift every
    row, and a short last row is refused; a 4:2:2 pixel pair needs an even width."""
    pixel = check_image(encoding, height, width, step, size, bridged=True)
    if step % pixel:
        raise ValueError(f'{encoding} image step {step} is not a whole number of '
                         f'{pixel}-byte pixels, which cv_bridge needs')
    if size < step * height:
        raise ValueError(f'image data has {size} bytes, cv_bridge needs all {height} rows of '
                         f'step {step} ({step * height})')
    if encoding.startswith('yuv422') and width % 2:
        raise ValueError(f'{encoding} image width {width} is odd; 4:2:2 pixels come in pairs')


def to_rgb(encoding: str, height: int, width: int, step: int, data) -> np.ndarray:
    """An HxWx3 uint8 RGB array from a raw image buffer (rows may be padded to `step`)."""
    buf = np.frombuffer(data, dtype=np.uint8)
    channels = check_image(encoding, height, width, step, buf.size)
    if buf.size < step * height:
        # The last row's padding may be cut off; pad so the strided view below is valid.
        buf = np.concatenate([buf, np.zeros(step * height - buf.size, np.uint8)])
    rows = buf[: step * height].reshape(height, step)[:, : width * channels]
    px = rows.reshape(height, width, channels)
    if encoding == 'rgb8':
        out = px
    elif encoding == 'bgr8':
        out = px[:, :, ::-1]
    elif encoding == 'rgba8':
        out = px[:, :, :3]
    elif encoding == 'bgra8':
        out = px[:, :, 2::-1]
    else:  # mono8; repeat already makes a new array
        return np.repeat(px, 3, axis=2)
    # A private, contiguous copy: the message buffer may be reused once we return.
    return np.array(out, dtype=np.uint8, order='C')


_bridge = None
_bridge_checked = False


def bridge():
    """A cv_bridge CvBridge where cv_bridge is installed, else None."""
    global _bridge, _bridge_checked
    if not _bridge_checked:
        _bridge_checked = True
        try:
            from cv_bridge import CvBridge

            _bridge = CvBridge()
        except ImportError:
            _bridge = None
    return _bridge


def _via_bridge(encoding: str) -> bool:
    return bridge() is not None and encoding not in BUILT_IN_FIRST and (
        encoding in ENCODINGS or encoding in BRIDGE_ENCODINGS)


def image_problem(msg, max_pixels: int = MAX_PIXELS, max_bytes: int = MAX_BYTES) -> str | None:
    """Why a sensor_msgs/Image cannot be converted, or None. Only reads the header and the
    buffer length, so a subscription callback can afford it."""
    header = (msg.encoding, msg.height, msg.width, msg.step, len(msg.data))
    try:
        check_size(msg.width, msg.height, len(msg.data), max_pixels, max_bytes)
        if _via_bridge(msg.encoding):
            check_bridged(*header)
        else:
            check_image(*header, bridged=bridge() is not None)
    except ValueError as e:
        return str(e)
    return None


def image_to_rgb(msg) -> np.ndarray:
    """HxWx3 uint8 RGB from a sensor_msgs/Image.

    Built in: rgb8, bgr8, rgba8, bgra8 and mono8, the encodings most robot cameras publish.
    Where cv_bridge is installed it also converts 16-bit colour and mono, YUV 4:2:2 and Bayer
    images, and takes the 8-bit encodings it converts faster (BUILT_IN_FIRST keeps the rest).
    """
    if not _via_bridge(msg.encoding):
        return to_rgb(msg.encoding, msg.height, msg.width, msg.step, msg.data)
    check_bridged(msg.encoding, msg.height, msg.width, msg.step, len(msg.data))
    try:
        out = bridge().imgmsg_to_cv2(msg, desired_encoding='rgb8')
    except Exception as e:  # cv_bridge raises its own error types
        raise ValueError(f'cv_bridge cannot convert the {msg.encoding!r} image: {e}') from None
    # A private, contiguous copy: for some encodings cv_bridge returns a view of the message.
    return np.array(out, dtype=np.uint8, order='C')


# What the publisher calls colour (sensor_msgs image_encodings isColor).
COLOUR = ('rgb8', 'bgr8', 'rgba8', 'bgra8', 'rgb16', 'bgr16', 'rgba16', 'bgra16')
MAGIC = {'jpeg': (b'\xff\xd8\xff',), 'png': (b'\x89PNG\r\n\x1a\n',),
         'tiff': (b'II*\x00', b'MM\x00*')}
PNG_END = b'\x00\x00\x00\x00IEND\xaeB`\x82'
# OpenCV 4.11 reads a PNG chunk by chunk and allocates what a chunk's length field says
# before it finds the payload shorter (a 1 kB PNG saying 3 GB took 2.9 GB and 7 s): every
# length is checked against the payload first. Encoders write a few dozen chunks.
MAX_CHUNKS = 10_000
# A progressive JPEG is decoded once per scan: thousands of tiny scans make a small payload
# cost minutes. Encoders write about ten.
MAX_SCANS = 100
FORMAT = re.compile(r'(?P<enc>[^;]*); (?P<codec>jpeg|png|tiff) compressed ?(?P<packed>\S*)')
# What each codec may hold, per the publisher.
PACKED = {'jpeg': ('bgr8', 'mono8'), 'png': ('bgr8', 'bgr16', ''), 'tiff': ('',)}
# Channels and bits of the raw encodings a png or tiff of the image as it was decodes to (a
# png holds 1, 3 or 4 channels: not YUV 4:2:2's 2, which the publisher fails to compress).
LAYOUT = {'rgb8': (3, 8), 'bgr8': (3, 8), 'rgba8': (4, 8), 'bgra8': (4, 8), 'mono8': (1, 8),
          'rgb16': (3, 16), 'bgr16': (3, 16), 'rgba16': (4, 16), 'bgra16': (4, 16),
          'mono16': (1, 16),
          **{f'bayer_{p}{b}': (1, b) for p in ('rggb', 'bggr', 'gbrg', 'grbg') for b in (8, 16)}}


@dataclass(frozen=True)
class Format:
    encoding: str  # the raw image's; '' for the older plain formats
    codec: str  # jpeg, png or tiff
    packed: str  # what was compressed: bgr8, bgr16, mono8, '' (as it was)


def parse_format(text: str) -> Format:
    """The parts of a CompressedImage `format`, or ValueError saying why it is not one this
    module decodes."""
    if text in ('jpeg', 'png'):
        return Format('', text, '')
    if 'compressedDepth' in text:
        return _refuse(f'{text!r} is a compressed depth image (compressed_depth_image_transport'
                       '), not colour')
    m = FORMAT.fullmatch(text)
    if m is None:
        return _refuse(f'unknown compressed image format {text!r}; expected image_transport\'s '
                       "'<encoding>; jpeg|png|tiff compressed <target>', or 'jpeg' / 'png'")
    enc, codec, packed = m['enc'], m['codec'], m['packed']
    if NOT_COLOUR.fullmatch(enc):
        return _refuse(f'format {text!r}: {enc} is a depth or single-value image, not colour')
    if enc not in ENCODINGS and enc not in BRIDGE_ENCODINGS:
        return _refuse(f'format {text!r}: unknown image encoding {enc!r}')
    if packed not in PACKED[codec]:
        return _refuse(f'format {text!r}: image_transport writes {codec} as '
                       + ' or '.join(repr(p) for p in PACKED[codec]) + f', not {packed!r}')
    colour = enc in COLOUR
    if (packed.startswith('bgr') and not colour) or (packed in ('mono8', '') and colour
                                                     and codec != 'tiff'):
        return _refuse(f'format {text!r}: a {enc} image is not compressed as {packed!r}')
    if packed == 'bgr16' and not enc.endswith('16'):
        return _refuse(f'format {text!r}: an 8-bit {enc} image is not compressed as bgr16')
    if packed == '' and enc not in LAYOUT:
        return _refuse(f'format {text!r}: a {codec} of a {enc} image is not decoded; '
                       'supported: ' + ', '.join(LAYOUT))
    return Format(enc, codec, packed)


def _refuse(why: str):
    raise ValueError(why)


def unavailable() -> str | None:
    """Why compressed images cannot be decoded here, or None."""
    try:
        import cv2  # noqa: F401
    except ImportError:
        return ('decoding it needs OpenCV (cv2), which is not installed: apt install '
                'python3-opencv, or pip install opencv-python-headless==4.11.0.86')
    return None


def _kind(data: bytes) -> str | None:
    return next((k for k, sigs in MAGIC.items() if data.startswith(sigs)), None)


def header_size(codec: str, data: bytes) -> tuple[int, int, int]:
    """(width, height, bytes per pixel once decoded) from a JPEG's, PNG's or TIFF's header
    (TIFF: its first directory, the image OpenCV decodes), without decoding it. ValueError
    when the header is not there or not readable."""
    if codec == 'png':
        if len(data) < 26 or data[12:16] != b'IHDR':
            raise ValueError('PNG without its IHDR header')
        # Colour type: grey, -, RGB, palette (decoded as BGR), grey + alpha, -, RGBA.
        channels = {0: 1, 2: 3, 3: 3, 4: 2, 6: 4}.get(data[25], 4)
        return (int.from_bytes(data[16:20], 'big'), int.from_bytes(data[20:24], 'big'),
                channels * (2 if data[24] > 8 else 1))
    if codec == 'tiff':
        return _tiff_size(data)
    # Walk the marker segments up to the frame header (SOFn), which holds the size.
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            break
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # no length
            i += 2
            continue
        if marker == 0xDA:  # scan data before any frame header
            break
        length = int.from_bytes(data[i + 2:i + 4], 'big')
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            if i + 10 > n:
                break
            # Decoded as grey or BGR, 16-bit values for more than 8 bits of precision.
            per = (1 if data[i + 9] == 1 else 3) * (2 if data[i + 4] > 8 else 1)
            return (int.from_bytes(data[i + 7:i + 9], 'big'),
                    int.from_bytes(data[i + 5:i + 7], 'big'), per)
        i += 2 + length
    raise ValueError('JPEG without a readable frame header (SOF)')


def _png_chunks(data: bytes) -> None:
    """ValueError unless the PNG's chunks (length, type, data, CRC) tile the payload."""
    i, n, count = 8, len(data), 0
    while i < n:
        count += 1
        if count > MAX_CHUNKS:
            raise ValueError(f'PNG of more than {MAX_CHUNKS} chunks')
        if i + 12 > n:
            raise ValueError(f'PNG chunk at byte {i} cut short')
        size = int.from_bytes(data[i:i + 4], 'big')
        if i + 12 + size > n:
            raise ValueError(f'PNG chunk at byte {i} says {size} bytes, past the end of the '
                             f'{n}-byte payload')
        i += 12 + size


def _tiff_size(data: bytes) -> tuple[int, int, int]:
    """ImageWidth, ImageLength and SamplesPerPixel x BitsPerSample of a TIFF's first image
    file directory (TIFF 6.0, section 2)."""
    order = 'little' if data[:2] == b'II' else 'big'

    def read(at: int, n: int) -> int:
        if at + n > len(data):
            raise ValueError(f'TIFF directory runs past the {len(data)}-byte payload')
        return int.from_bytes(data[at:at + n], order)

    ifd = read(4, 4)
    tags: dict[int, list[int]] = {}
    for k in range(read(ifd, 2)):
        e = ifd + 2 + 12 * k
        tag, kind, count = read(e, 2), read(e + 2, 2), read(e + 4, 4)
        if tag not in (256, 257, 258, 277):
            continue
        if tag in tags:
            raise ValueError(f'TIFF directory gives tag {tag} twice')
        size = {3: 2, 4: 4}.get(kind)  # SHORT, LONG
        most = 8 if tag == 258 else 1  # BitsPerSample: one a sample
        if size is None or not 1 <= count <= most:
            raise ValueError(f'TIFF tag {tag}: {count} values of type {kind}, not 1 to {most} '
                             'SHORT or LONG values')
        at = e + 8 if count * size <= 4 else read(e + 8, 4)
        tags[tag] = [read(at + j * size, size) for j in range(count)]
    if 256 not in tags or 257 not in tags:
        raise ValueError('TIFF without ImageWidth and ImageLength in its first directory')
    spp = tags.get(277, [1])[0]
    bits = max(tags.get(258, [1]))
    if not 1 <= spp <= 4 or bits > 16:
        raise ValueError(f'TIFF of {spp} samples per pixel of {bits} bits: at most 4 of 16 '
                         'are decoded')
    return tags[256][0], tags[257][0], spp * (2 if bits > 8 else 1)


def check_payload(fmt: Format, data: bytes, max_pixels: int = MAX_PIXELS,
                  max_bytes: int = MAX_BYTES) -> tuple[int, int]:
    """ValueError unless `data` looks like a whole image of `fmt`'s codec, within the caps:
    `max_bytes` for the payload and for what it decodes to, `max_pixels` for its size. Returns
    its (width, height) from the header. Cheap: no decoding."""
    if not data:
        raise ValueError(f'empty {fmt.codec} payload')
    name = fmt.codec.upper()
    if len(data) > max_bytes:
        raise ValueError(f'{name} payload of {len(data)} bytes is over max_image_bytes '
                         f'({max_bytes})')
    kind = _kind(data)
    if kind != fmt.codec:
        what = f'a {kind.upper()}' if kind else f'not a {name} (it starts {data[:4].hex()})'
        raise ValueError(f'the format says {fmt.codec} but the {len(data)}-byte payload is '
                         f'{what}')
    if fmt.codec == 'jpeg' and not data.rstrip(b'\x00').endswith(b'\xff\xd9'):
        raise ValueError(f'the {len(data)}-byte JPEG has no end-of-image marker: cut short')
    if fmt.codec == 'png' and not data.endswith(PNG_END):
        raise ValueError(f'the {len(data)}-byte PNG has no IEND chunk at its end: cut short')
    if fmt.codec == 'png':
        _png_chunks(data)
    w, h, per = header_size(fmt.codec, data)
    if min(w, h) <= 0:
        raise ValueError(f'{name} header says {w}x{h} pixels')
    check_size(w, h, w * h * per, max_pixels, max_bytes, f'{name} header says an image')
    if fmt.codec == 'jpeg':
        # Markers inside scan data are escaped (FF 00), so this counts scan headers.
        scans = data.count(b'\xff\xda')
        if scans > MAX_SCANS:
            raise ValueError(f'JPEG of {scans} scans (at most {MAX_SCANS} taken)')
    return w, h


def _imdecode(data: bytes, via: str):
    import cv2

    if via == 'cv_bridge':
        b = bridge()
        if b is None:
            raise ValueError('cv_bridge is not installed')
        try:
            return b.compressed_imgmsg_to_cv2(SimpleNamespace(data=data), 'passthrough')
        except Exception as e:  # cv_bridge and OpenCV raise their own error types
            raise ValueError(f'cv_bridge cannot decode it: {e}') from None
    try:
        return cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    except cv2.error as e:
        raise ValueError(f'OpenCV cannot decode it: {e}') from None


def to_8bit(px: np.ndarray) -> np.ndarray:
    """16-bit values scaled to 8 as cv_bridge scales them (x * 255 / 65535, rounded), so a
    16-bit PNG gives what the same raw 16-bit image gives through cv_bridge."""
    return ((px.astype(np.uint32) * 255 + 32767) // 65535).astype(np.uint8)


def decode(fmt_text: str, data, via: str = 'auto', max_pixels: int = MAX_PIXELS,
           max_bytes: int = MAX_BYTES) -> np.ndarray:
    """HxWx3 uint8 RGB from a CompressedImage's `format` and `data`, or ValueError.

    `via`: 'cv_bridge', 'cv2', or 'auto' (cv_bridge where installed); the caps as for
    check_payload."""
    fmt = parse_format(fmt_text)
    if len(data) > max_bytes:  # before copying it
        raise ValueError(f'{fmt.codec.upper()} payload of {len(data)} bytes is over '
                         f'max_image_bytes ({max_bytes})')
    data = bytes(data)
    return _decode(fmt, fmt_text, data, check_payload(fmt, data, max_pixels, max_bytes), via)


def _decode(fmt: Format, fmt_text: str, data: bytes, size, via: str) -> np.ndarray:
    import cv2

    if via == 'auto':
        via = 'cv_bridge' if bridge() is not None else 'cv2'
    px = _imdecode(data, via)
    if px is None or px.size == 0:
        raise ValueError(f'the {len(data)}-byte {fmt.codec.upper()} is corrupt: it does not '
                         'decode')
    h, w = px.shape[:2]
    if size != (w, h):
        raise ValueError(f'decoded {w}x{h}, its header says {size[0]}x{size[1]}')
    channels = 1 if px.ndim == 2 else px.shape[2]
    bits = {np.dtype(np.uint8): 8, np.dtype(np.uint16): 16}.get(px.dtype)
    # What the format says the decoded image must be: channels, bits, and its channel order.
    if not fmt.encoding:  # older plain 'jpeg' / 'png'
        want, want_bits = (channels if channels in (1, 3) else 3), 8
        order = 'bgr' if want == 3 else 'mono'
    elif fmt.packed.startswith('bgr'):
        want, want_bits, order = 3, int(fmt.packed[3:]), 'bgr'
    elif fmt.packed == 'mono8':
        want, want_bits, order = 1, 8, 'mono'
    else:  # a png or tiff of the raw image as it was
        want, want_bits = LAYOUT[fmt.encoding]
        order = re.sub(r'\d+$', '', fmt.encoding)
    if channels != want or bits != want_bits:
        raise ValueError(f'format {fmt_text!r} but the {fmt.codec.upper()} decodes to '
                         f'{channels} channel(s) of {px.dtype}, not {want} of '
                         f'{want_bits}-bit values')
    if order.startswith('bayer'):
        # The raw image itself: converted exactly as the raw path converts it (cv_bridge).
        raw = SimpleNamespace(encoding=fmt.encoding, height=h, width=w, step=w * px.itemsize,
                              is_bigendian=0, data=np.ascontiguousarray(px).tobytes())
        return image_to_rgb(raw)
    if bits == 16:
        px = to_8bit(px)
    code = {'mono': cv2.COLOR_GRAY2RGB, 'rgb': None, 'bgr': cv2.COLOR_BGR2RGB,
            'rgba': cv2.COLOR_RGBA2RGB, 'bgra': cv2.COLOR_BGRA2RGB}[order]
    out = px if code is None else cv2.cvtColor(px, code)
    return np.array(out, dtype=np.uint8, order='C')


def encode(px: np.ndarray, encoding: str, codec: str, value: int) -> tuple[str, bytes]:
    """(format, data) of a CompressedImage as image_transport's compressed plugin makes it
    from an 8-bit raw image `px` in `encoding` (rgb8, bgr8, rgba8, bgra8, mono8): colour is
    compressed as BGR, mono as it is; `value` is the jpeg quality or the png level."""
    import cv2

    if encoding == 'mono8':
        packed, target = ('mono8' if codec == 'jpeg' else ''), px
    else:
        packed = 'bgr8'
        code = {'rgb8': cv2.COLOR_RGB2BGR, 'rgba8': cv2.COLOR_RGBA2BGR,
                'bgra8': cv2.COLOR_BGRA2BGR}.get(encoding)
        target = px if code is None else cv2.cvtColor(px, code)
    if codec == 'jpeg':
        ok, data = cv2.imencode('.jpg', target, [cv2.IMWRITE_JPEG_QUALITY, value])
    else:
        ok, data = cv2.imencode('.png', target, [cv2.IMWRITE_PNG_COMPRESSION, value])
    if not ok:
        raise ValueError(f'cv2.imencode ({codec}) failed')
    return f'{encoding}; {codec} compressed {packed}', data.tobytes()


class Camera:
    """One compressed camera's decoding: every image must have the size of the first good
    one (a camera does not change its resolution while the node runs; an image that does
    is a broken one, and the model would see another scene scale)."""

    def __init__(self, via: str = 'auto', max_pixels: int = MAX_PIXELS,
                 max_bytes: int = MAX_BYTES):
        self.via = via
        self.max_pixels, self.max_bytes = max_pixels, max_bytes
        self.size: tuple[int, int] | None = None  # (width, height) of the first good image

    def decode(self, fmt_text: str, data) -> np.ndarray:
        fmt = parse_format(fmt_text)
        if len(data) > self.max_bytes:  # before copying it
            raise ValueError(f'{fmt.codec.upper()} payload of {len(data)} bytes is over '
                             f'max_image_bytes ({self.max_bytes})')
        data = bytes(data)
        size = check_payload(fmt, data, self.max_pixels, self.max_bytes)
        # From the header: a payload of another size is not even decoded.
        if self.size is not None and size != self.size:
            raise self._resized(size)
        rgb = _decode(fmt, fmt_text, data, size, self.via)
        got = (rgb.shape[1], rgb.shape[0])
        if self.size is None:
            self.size = got
        elif got != self.size:
            raise self._resized(got)
        return rgb

    def _resized(self, got):
        return ValueError(f'{got[0]}x{got[1]} image, but this camera sent '
                          f'{self.size[0]}x{self.size[1]} before (reconfigure the node to '
                          'take a new resolution)')
