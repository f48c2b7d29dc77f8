"""Time one camera frame through each image conversion path: the built-in one and cv_bridge,
raw and compressed.

    python tools/bench_images.py [--width 640 --height 480 --repeats 300]
    python tools/bench_images.py --compressed [--cameras 4 --rate 60]

Run where cv_bridge is sourced (make test builds it when OXYGEN_CV_BRIDGE_SRC is given; see
tools/ws.sh). Prints the median milliseconds per frame for every encoding each path converts,
including the private copy the node keeps; images.BUILT_IN_FIRST is chosen from these numbers.

--compressed: on oxygen_ros.sim.scene's synthetic table-top image (smooth wall, wood grain, shaded
objects with hard edges, sensor noise; not random noise, which no codec compresses), the
bytes per frame and per second for `--cameras` cameras at `--rate` Hz, raw rgb8 against
JPEG (quality 80, 90, 95) and PNG (level 3, image_transport's default), compressed as
image_transport's plugin does (images.encode), and the median ms of the node's whole
conversion of one frame (images.decode: checks, decode, RGB) through cv2 and cv_bridge.
"""
import argparse
import time

import numpy as np
from sensor_msgs.msg import Image

from oxygen_ros.robot import images


def message(encoding: str, width: int, height: int, pixel: int) -> Image:
    m = Image()
    m.height, m.width, m.encoding, m.step = height, width, encoding, width * pixel
    m.data = np.random.default_rng(0).integers(0, 256, height * width * pixel, np.uint8).tobytes()
    return m


def median_ms(fn, repeats: int) -> float:
    fn()  # first call: imports, allocations
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


def compressed(args, bridge) -> None:
    from oxygen_ros.robot import images
    from oxygen_ros.sim.scene import render

    rgb = render(args.width, args.height, seed=0)
    raw = rgb.tobytes()
    n = args.cameras * args.rate
    print(f'{args.width}x{args.height} scene, {args.cameras} cameras at {args.rate:g} Hz, '
          f'median of {args.repeats}')
    print('| transport | bytes/frame | MB/s, all cameras | encode ms | decode ms, cv2 | '
          'decode ms, cv_bridge |')
    print('|---|---|---|---|---|---|')
    ms = median_ms(lambda: images.to_rgb('rgb8', args.height, args.width, args.width * 3, raw),
                   args.repeats)
    print(f'| raw rgb8 | {len(raw)} | {len(raw) * n / 1e6:.1f} | | {ms:.3f} (built in) | |')
    for codec, value in (('jpeg', 80), ('jpeg', 90), ('jpeg', 95), ('png', 3)):
        enc = median_ms(lambda c=codec, v=value: images.encode(rgb, 'rgb8', c, v),
                        max(args.repeats // 10, 10))
        fmt, data = images.encode(rgb, 'rgb8', codec, value)
        times = [median_ms(lambda via=via, f=fmt, d=data: images.decode(f, d, via),
                           args.repeats)
                 if via == 'cv2' or bridge is not None else float('nan')
                 for via in ('cv2', 'cv_bridge')]
        name = f'{codec} q{value}' if codec == 'jpeg' else f'png level {value}'
        print(f'| {name} | {len(data)} | {len(data) * n / 1e6:.1f} | {enc:.2f} | '
              f'{times[0]:.3f} | {times[1]:.3f} |')


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--width', type=int, default=640)
    p.add_argument('--height', type=int, default=480)
    p.add_argument('--repeats', type=int, default=300)
    p.add_argument('--compressed', action='store_true', help='compressed images instead')
    p.add_argument('--cameras', type=int, default=4, help='with --compressed (ALOHA: 4)')
    p.add_argument('--rate', type=float, default=60.0, help='with --compressed, Hz')
    args = p.parse_args()
    bridge = images.bridge()
    if args.compressed:
        compressed(args, bridge)
        return
    if bridge is None:
        raise SystemExit('cv_bridge is not importable: source its install space first')

    def via_bridge(m):
        return np.array(bridge.imgmsg_to_cv2(m, 'rgb8'), dtype=np.uint8, order='C')

    print(f'{args.width}x{args.height}, median of {args.repeats}, ms per frame')
    print('| encoding | built-in | cv_bridge |')
    print('|---|---|---|')
    for encoding, pixel in [*images.ENCODINGS.items(), *images.BRIDGE_ENCODINGS.items()]:
        m = message(encoding, args.width, args.height, pixel)
        built_in = ''
        if encoding in images.ENCODINGS:
            ms = median_ms(lambda m=m: images.to_rgb(m.encoding, m.height, m.width, m.step,
                                                     m.data), args.repeats)
            built_in = f'{ms:.3f}'
        ms = median_ms(lambda m=m: via_bridge(m), args.repeats)
        print(f'| {encoding} | {built_in} | {ms:.3f} |')


if __name__ == '__main__':
    main()
