"""Fuzzing what the node reads from outside: camera images, robot files, fleet files and
parameters, with hypothesis.

    python tools/fuzz.py [TARGET ...] [--examples N] [--batch B] [--rss-mb M] [--seed S]

Targets (all by default):
  raw         sensor_msgs/Image-like messages: images.image_problem, then image_to_rgb
  compressed  images.decode of JPEG, PNG and TIFF payloads OpenCV wrote, mutated (bytes
              flipped, cut, inserted; header sizes, depths and counts overwritten), under
              formats image_transport writes and mutated ones
  robot_file  params.read_robot_file of YAML params files (valid ones changed, broken
              text, anchors and aliases, deep nesting), then robot_config on what it read
  fleet_file  fleet_file.load of YAML fleet files, likewise
  params      contract.Config.from_values on parameter values of any type, and
              command_line_params on command lines

Each input passes or raises the documented error: ValueError for images and fleet files
(image_problem returns its reason instead), StartError for robot files and parameters,
nothing for command lines. Anything else fails the target with the input hypothesis
shrank it to. Images are decoded under small caps (max_image_pixels 65536, max_image_bytes
1 MiB), so every decode is bounded; memory is checked over the run: the resident set after
the first batch (imports and caches warm) may grow by at most --rss-mb by the end, and the
process's peak (what one input made a decoder allocate, even if freed) may lie at most
--peak-mb above it. (A PNG chunk length of 3 GB made OpenCV 4.11 allocate 2.9 GB: found
this way, refused from the header now.)
Hypothesis's own bookkeeping grows with the examples of one run, so the inputs come in
batches of --batch, each a fresh run with its own seed. One line per target: inputs,
seconds, resident set after the first batch and at the end, and the process's max RSS.
OpenCV's and libpng's warnings about broken images are silenced (fd 2) while fuzzing.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import resource
import struct
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import yaml
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oxygen_ros.robot import images  # noqa: E402
from oxygen_ros.robot.contract import Config, robot_config  # noqa: E402
from oxygen_ros.robot.params import PARAMS, StartError, command_line_params, read_robot_file  # noqa: E402
from oxygen_ros.ros import fleet_file

CAP_PIXELS, CAP_BYTES = 1 << 16, 1 << 20

# -- values ------------------------------------------------------------------------------

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.integers(-3, 300),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
    st.sampled_from(['', 'raw', 'compressed', 'droid', 'aloha', 'identity', 'cpu',
                     '{velocity: true}', '{dim: 3}', '[a, b]', 'front', 'wrist']))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=8), inner, max_size=5)),
    max_leaves=20)

# A robot that configures, for the mutations to start from.
ROBOT = {
    'robot': 'identity', 'cameras': ['front', 'wrist'],
    'camera_slots': ['base_0_rgb', 'left_wrist_0_rgb'], 'joints': ['a', 'b'],
    'output_groups': ['arm'],
    'outputs': {'arm': {'topic': 'arm/cmd', 'joints': ['a', 'b'], 'indices': [0, 1]}},
    'joint_limits': {'arm': {'a': {'lower': -1.0, 'upper': 1.0, 'velocity': 2.0}}},
}
NAMES = [p.name for p in PARAMS] + [
    'outputs.arm.topic', 'outputs.arm.joints', 'outputs.arm.indices', 'outputs.hand.topic',
    'joint_limits.arm.a.lower', 'joint_limits.arm.a.upper', 'joint_limits.arm.a.velocity',
    'joint_limits.arm.b.acceleration', 'joint_limits.arm.a.jerk', 'joint_limits.arm',
    'joint_limits.nope.a.lower', 'namespace', 'robot_file', 'no_such_parameter']


def flat(tree: dict, prefix: str = '') -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat(v, f'{prefix}{k}.'))
        else:
            out[f'{prefix}{k}'] = v
    return out


@st.composite
def param_values(draw) -> dict:
    out = flat(ROBOT) if draw(st.booleans()) else {}
    for name in draw(st.lists(st.sampled_from(NAMES), max_size=6)):
        out[name] = draw(values)
    for name in draw(st.lists(st.sampled_from(sorted(out) or ['robot']), max_size=2)):
        out.pop(name, None)
    return out


def nested(flat_values: dict) -> dict:
    """A params file's nesting of flat names (a.b.c: 1 -> {a: {b: {c: 1}}}), where it can."""
    tree: dict = {}
    for name, v in flat_values.items():
        *path, last = name.split('.')
        at = tree
        for p in path:
            nxt = at.setdefault(p, {})
            if not isinstance(nxt, dict):
                break
            at = nxt
        else:
            at[last] = v
    return tree


def mutated_text(draw, text: str) -> str:
    """`text` with a few characters changed, cut, or YAML constructs put in."""
    for _ in range(draw(st.integers(0, 3))):
        i = draw(st.integers(0, len(text)))
        op = draw(st.sampled_from(['insert', 'delete', 'cut', 'snippet']))
        if op == 'insert':
            text = text[:i] + draw(st.text(max_size=4)) + text[i:]
        elif op == 'delete':
            text = text[:i] + text[i + draw(st.integers(1, 8)):]
        elif op == 'cut':
            text = text[:i]
        else:
            text = text[:i] + draw(st.sampled_from(SNIPPETS)) + text[i:]
    return text


# YAML that parsers and what reads their output trip on.
SNIPPETS = [
    ': ', '- ', '{', '[', ']', '}', '&a ', '*a', '!!python/object:os.system ', '!!binary x',
    '2001-02-30', '2001-13-01 25:61:61', '0x' + 'f' * 40, '1e400', '.nan', '.inf', '~',
    '? [a, b]\n: c\n', '<<: *a\n', '%YAML 9.9\n---\n', '\t', '\x00', '\ufeff', '"\\x', "'",
    '|\n  text\n', '>-\n', '!!set {a, b}', '!!omap [a: 1]', '!!timestamp 99999-01-01',
]


def alias_bomb(draw, width: int, depth: int, mapping: bool) -> str:
    """Each level names the one below `width` times: width ** depth leaves from a small
    text (the billion laughs)."""
    lines = ['l0: &l0 ' + ('{k: x}' if mapping else '[x]')]
    for d in range(1, depth + 1):
        if mapping:
            body = '{' + ', '.join(f'k{j}: *l{d - 1}' for j in range(width)) + '}'
        else:
            body = '[' + ', '.join(f'*l{d - 1}' for _ in range(width)) + ']'
        lines.append(f'l{d}: &l{d} {body}')
    return '\n'.join(lines) + '\n'


@st.composite
def robot_files(draw) -> bytes:
    kind = draw(st.sampled_from(['params', 'params', 'mutated', 'bomb', 'deep', 'bytes']))
    params = nested(draw(param_values()))
    if kind == 'bytes':
        return draw(st.binary(max_size=300))
    if kind == 'deep':
        n = draw(st.integers(50, 20000))
        open_, close = draw(st.sampled_from([('[', ']'), ('{a: ', '}'), ('- ', '')]))
        inner = open_ * n + 'x' + close * n
        where = draw(st.sampled_from(['top', 'param']))
        body = inner if where == 'top' else f'n:\n  ros__parameters:\n    prompt: {inner}\n'
        return body.encode()
    if kind == 'bomb':
        bomb = alias_bomb(draw, draw(st.integers(2, 10)), draw(st.integers(2, 9)),
                          draw(st.booleans()))
        at = draw(st.sampled_from(['prompt', 'cameras', 'joint_limits', 'outputs', 'x']))
        body = '\n'.join('    ' + line for line in bomb.splitlines())
        last = bomb.splitlines()[-1].split(':')[0]
        return (f'n:\n  ros__parameters:\n{body}\n    {at}: *{last}\n').encode()
    text = yaml.safe_dump({draw(st.sampled_from(['n', '/**', 'a/b'])): {
        'ros__parameters': params}}, allow_unicode=True)
    if kind == 'mutated':
        text = mutated_text(draw, text)
    return text.encode('utf-8', 'surrogatepass')


@st.composite
def fleet_files(draw) -> bytes:
    kind = draw(st.sampled_from(['valid', 'valid', 'mutated', 'bomb', 'deep', 'bytes']))
    if kind == 'bytes':
        return draw(st.binary(max_size=300))
    if kind == 'deep':
        n = draw(st.integers(50, 20000))
        return ('servers:\n  a: ' + '[' * n + ']' * n + '\n').encode()
    if kind == 'bomb':
        bomb = alias_bomb(draw, draw(st.integers(2, 10)), draw(st.integers(2, 9)),
                          draw(st.booleans()))
        last = bomb.splitlines()[-1].split(':')[0]
        return (bomb + f'servers:\n  {draw(st.sampled_from(["a", "*l0"]))}: *{last}\n').encode()
    names = st.one_of(st.sampled_from(['a', 'b', 'gpu_a', 'left', 'right', '1x', 'a-b', '']),
                      st.text(max_size=6))
    servers = draw(st.dictionaries(names, st.one_of(st.lists(names, max_size=4), names,
                                                    values), max_size=4))
    doc = draw(st.sampled_from([{'servers': servers}, servers, {'servers': None}]))
    text = yaml.safe_dump(doc, allow_unicode=True)
    if kind == 'mutated':
        text = mutated_text(draw, text)
    return text.encode('utf-8', 'surrogatepass')


# -- images ------------------------------------------------------------------------------

RAW_ENCODINGS = sorted(images.ENCODINGS) + sorted(images.BRIDGE_ENCODINGS) + [
    '16UC1', '32FC1', '8UC3', '', 'RGB8', 'yuv422_yuy2 ']


@st.composite
def raw_images(draw):
    enc = draw(st.one_of(st.sampled_from(RAW_ENCODINGS), st.text(max_size=12)))
    pixel = images.ENCODINGS.get(enc) or images.BRIDGE_ENCODINGS.get(enc) or 3
    big = st.integers(0, 2**32 - 1)
    w = draw(st.one_of(st.integers(0, 40), big))
    h = draw(st.one_of(st.integers(0, 40), big))
    step = draw(st.one_of(st.just(w * pixel), st.integers(w * pixel, w * pixel + 9),
                          st.integers(0, 2**32 - 1)))
    need = step * h
    if need <= 8192 and draw(st.booleans()):
        n = max(0, need + draw(st.integers(-step - 2, 4)))
    else:
        n = draw(st.integers(0, 8192))
    data = draw(st.binary(min_size=min(n, 64), max_size=min(n, 64)))
    data = (data * (n // max(len(data), 1) + 1))[:n] if data else bytes(n)
    return SimpleNamespace(encoding=enc, width=w, height=h, step=step,
                           is_bigendian=draw(st.integers(0, 1)), data=data)


def check_raw(msg) -> None:
    why = images.image_problem(msg, CAP_PIXELS, CAP_BYTES)
    if why is not None:
        assert isinstance(why, str) and why
        return
    try:
        out = images.image_to_rgb(msg)
    except ValueError:
        return
    assert out.shape == (msg.height, msg.width, 3) and out.dtype == np.uint8, out.shape


def encoded(codec: str, px: np.ndarray, params=()) -> bytes:
    import cv2

    ext = {'jpeg': '.jpg', 'png': '.png', 'tiff': '.tiff'}[codec]
    ok, data = cv2.imencode(ext, px, list(params))
    assert ok
    return data.tobytes()


FORMATS = {
    'jpeg': ['rgb8; jpeg compressed bgr8', 'bgr8; jpeg compressed bgr8', 'jpeg',
             'mono8; jpeg compressed mono8', 'rgb16; jpeg compressed bgr8',
             'bayer_rggb8; jpeg compressed mono8'],
    'png': ['rgb8; png compressed bgr8', 'rgba8; png compressed bgr8', 'png',
            'mono8; png compressed ', 'rgb16; png compressed bgr16', 'mono16; png compressed ',
            'bayer_rggb8; png compressed ', 'rgba16; png compressed '],
    'tiff': ['rgb8; tiff compressed ', 'mono8; tiff compressed ', 'rgba16; tiff compressed ',
             'bgr8; tiff compressed', 'mono16; tiff compressed ', 'bayer_gbrg16; tiff compressed '],
}


def header_fields(codec: str, data: bytes) -> list[tuple[int, int]]:
    """(offset, bytes) of the size, depth and count fields of a payload's header."""
    if codec == 'png':
        return [(16, 4), (20, 4), (24, 1), (25, 1), (8, 4)]
    if codec == 'jpeg':
        out = []
        i = 2
        while i + 4 <= len(data) and data[i] == 0xFF:
            if data[i + 1] == 0xDA:
                break
            out.append((i + 2, 2))
            if 0xC0 <= data[i + 1] <= 0xCF and data[i + 1] not in (0xC4, 0xC8, 0xCC):
                out += [(i + 4, 1), (i + 5, 2), (i + 7, 2), (i + 9, 1)]
            i += 2 + int.from_bytes(data[i + 2:i + 4], 'big')
        return out
    e = '<' if data[:2] == b'II' else '>'
    ifd = struct.unpack(e + 'I', data[4:8])[0]
    if ifd + 2 > len(data):
        return [(4, 4)]
    n = min(struct.unpack(e + 'H', data[ifd:ifd + 2])[0], (len(data) - ifd - 2) // 12)
    out = [(4, 4), (ifd, 2)]
    for k in range(n):
        at = ifd + 2 + 12 * k
        out += [(at, 2), (at + 2, 2), (at + 4, 4), (at + 8, 4)]
    return out


@st.composite
def compressed_images(draw):
    codec = draw(st.sampled_from(['jpeg', 'png', 'tiff']))
    w, h = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    channels = draw(st.sampled_from([1, 3, 4] if codec != 'jpeg' else [1, 3]))
    dtype = np.uint16 if codec != 'jpeg' and draw(st.booleans()) else np.uint8
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shape = (h, w) if channels == 1 else (h, w, channels)
    px = rng.integers(0, np.iinfo(dtype).max, shape, dtype=dtype, endpoint=True)
    params = []
    if codec == 'jpeg':
        params = [1, draw(st.integers(1, 100))]  # IMWRITE_JPEG_QUALITY
        if draw(st.booleans()):
            params += [2, 1]  # IMWRITE_JPEG_PROGRESSIVE
    elif codec == 'tiff':
        params = [259, draw(st.sampled_from([1, 5, 8, 32773]))]  # IMWRITE_TIFF_COMPRESSION
    data = bytearray(encoded(codec, px, params))
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(['header', 'header', 'flip', 'cut', 'insert', 'repeat']))
        if op == 'header':
            fields = header_fields(codec, bytes(data)) if len(data) > 8 else []
            if fields:
                at, n = draw(st.sampled_from(fields))
                if at + n <= len(data):
                    v = draw(st.one_of(st.integers(0, 2 ** (8 * n) - 1), st.integers(0, 70)))
                    order = 'little' if data[:2] == b'II' else 'big'
                    data[at:at + n] = v.to_bytes(n, order)
        elif op == 'flip' and data:
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= draw(st.integers(1, 255))
        elif op == 'cut':
            del data[draw(st.integers(0, len(data))):]
        elif op == 'insert':
            i = draw(st.integers(0, len(data)))
            data[i:i] = draw(st.binary(max_size=16))
        else:  # a marker many times: scans, chunks, directories
            piece = draw(st.sampled_from([b'\xff\xda\x00\x02', b'IDAT', b'\xff\xd8',
                                          b'\x00\x01\x01\x00']))
            i = draw(st.integers(0, len(data)))
            data[i:i] = piece * draw(st.integers(1, 300))
    fmt = draw(st.one_of(st.sampled_from(FORMATS[codec]), st.sampled_from(sum(
        FORMATS.values(), [])), st.text(max_size=30)))
    via = draw(st.sampled_from(['cv2', 'cv_bridge'] if images.bridge() else ['cv2']))
    return fmt, bytes(data), via


def check_compressed(item) -> None:
    fmt, data, via = item
    try:
        out = images.decode(fmt, data, via, CAP_PIXELS, CAP_BYTES)
    except ValueError:
        return
    assert out.ndim == 3 and out.shape[2] == 3 and out.dtype == np.uint8, out.shape
    assert out.shape[0] * out.shape[1] <= CAP_PIXELS, out.shape


# -- files and parameters ----------------------------------------------------------------

_tmp = Path(tempfile.mkdtemp(prefix='oxygen-fuzz-'))


def check_robot_file(text: bytes) -> None:
    path = _tmp / 'robot.yaml'
    path.write_bytes(text)
    try:
        own, shared = read_robot_file('r', str(path))
        assert isinstance(own, dict) and isinstance(shared, list)
        robot_config('r', {}, own, {})
    except StartError as e:
        assert str(e) and len(str(e)) < 10_000, len(str(e))


def check_fleet_file(text: bytes) -> None:
    path = _tmp / 'fleet.yaml'
    path.write_bytes(text)
    try:
        table = fleet_file.load(path)
    except ValueError as e:
        assert str(e) and len(str(e)) < 10_000, len(str(e))
        return
    assert all(isinstance(r, list) and r for r in table.values())


@st.composite
def params_and_argv(draw):
    argv = draw(st.lists(st.one_of(
        st.sampled_from(['--ros-args', '-p', '--param', '--', '-r', 'x:=y']),
        st.builds(lambda n, v: f'{n}:={v}', st.sampled_from(NAMES + ['oxygen_node:prompt',
                                                                     '*:robot', 'a:b:c']),
                  st.one_of(st.text(max_size=12), st.sampled_from(SNIPPETS))),
        st.text(max_size=10)), max_size=8))
    return draw(param_values()), argv


def check_params(item) -> None:
    vals, argv = item
    got = command_line_params(argv, 'oxygen_node')
    assert isinstance(got, dict)
    try:
        Config.from_values(vals)
    except StartError as e:
        assert str(e) and len(str(e)) < 10_000, len(str(e))


TARGETS = {
    'raw': (raw_images(), check_raw),
    'compressed': (compressed_images(), check_compressed),
    'robot_file': (robot_files(), check_robot_file),
    'fleet_file': (fleet_files(), check_fleet_file),
    'params': (params_and_argv(), check_params),
}

# -- running -----------------------------------------------------------------------------


def rss_mb() -> float:
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 2**20


def max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


@contextlib.contextmanager
def quiet(on: bool = True):
    """fd 2 to /dev/null: libjpeg and libpng print a warning per broken image."""
    if not on:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(null)
        os.close(saved)


def fuzz(target: str, examples: int, batch: int = 1000, first_seed: int = 0,
         silent: bool = True) -> dict:
    """Run `examples` inputs of `target` in batches; raises on a failing input. Returns
    inputs, seconds and memory figures (MB)."""
    strategy, check = TARGETS[target]
    count = [0]

    def one(x):
        count[0] += 1
        check(x)

    t = time.monotonic()
    warm = None
    done = 0
    b = 0
    while done < examples:
        n = min(batch, examples - done)
        prop = settings(max_examples=n, database=None, deadline=None,
                        suppress_health_check=list(HealthCheck),
                        phases=(Phase.generate, Phase.shrink))(given(strategy)(one))
        with quiet(silent):
            seed(first_seed + b)(prop)()
        done += n
        b += 1
        gc.collect()
        if warm is None:
            warm = rss_mb()
    return dict(target=target, inputs=count[0], seconds=time.monotonic() - t, rss_warm=warm,
                rss_end=rss_mb(), max_rss=max_rss_mb())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('targets', nargs='*', help=f'of {", ".join(TARGETS)}; default all')
    ap.add_argument('--examples', type=int, default=1000)
    ap.add_argument('--batch', type=int, default=1000)
    ap.add_argument('--rss-mb', type=float, default=100.0,
                    help='most the resident set may grow after the first batch')
    ap.add_argument('--peak-mb', type=float, default=512.0,
                    help='most the peak resident set may lie above it after the first batch')
    ap.add_argument('--seed', type=int, default=0)
    ap.add_argument('--loud', action='store_true', help="keep the decoders' warnings")
    a = ap.parse_args(argv)
    unknown = sorted(set(a.targets) - set(TARGETS))
    if unknown:
        ap.error(f'unknown targets {unknown}; targets: {", ".join(TARGETS)}')
    bad = 0
    for target in a.targets or list(TARGETS):
        r = fuzz(target, a.examples, a.batch, a.seed, not a.loud)
        grew = r['rss_end'] - r['rss_warm']
        peak = r['max_rss'] - r['rss_warm']
        why = [w for w, over in (('MEMORY GREW', grew > a.rss_mb),
                                 ('PEAK OVER THE LIMIT', peak > a.peak_mb)) if over]
        bad += bool(why)
        print(f'{target}: {r["inputs"]} inputs in {r["seconds"]:.0f} s, RSS {r["rss_warm"]:.0f}'
              f' MB after the first batch, {r["rss_end"]:.0f} MB at the end (grew '
              f'{grew:+.1f} MB, limit {a.rss_mb:g}), max RSS {r["max_rss"]:.0f} MB (limit '
              f'{r["rss_warm"] + a.peak_mb:.0f})' + ''.join(f': {w}' for w in why), flush=True)
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
