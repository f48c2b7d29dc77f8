"""Time one camera frame through each image conversion path: the built-in one and cv_bridge.

    python tools/bench_images.py [--width 640 --height 480 --repeats 300]

Run where cv_bridge is sourced (make test builds it when OXYGEN_CV_BRIDGE_SRC is given; see
tools/ws.sh). Prints the median milliseconds per frame for every encoding each path converts,
including the private copy the node keeps; frames.BUILT_IN_FIRST is chosen from these numbers.
"""
import argparse
import time

import numpy as np
from sensor_msgs.msg import Image

from oxygen_ros import frames


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--width', type=int, default=640)
    p.add_argument('--height', type=int, default=480)
    p.add_argument('--repeats', type=int, default=300)
    args = p.parse_args()
    bridge = frames.bridge()
    if bridge is None:
        raise SystemExit('cv_bridge is not importable: source its install space first')

    def via_bridge(m):
        return np.array(bridge.imgmsg_to_cv2(m, 'rgb8'), dtype=np.uint8, order='C')

    print(f'{args.width}x{args.height}, median of {args.repeats}, ms per frame')
    print('| encoding | built-in | cv_bridge |')
    print('|---|---|---|')
    for encoding, pixel in [*frames.ENCODINGS.items(), *frames.BRIDGE_ENCODINGS.items()]:
        m = message(encoding, args.width, args.height, pixel)
        built_in = ''
        if encoding in frames.ENCODINGS:
            ms = median_ms(lambda m=m: frames.to_rgb(m.encoding, m.height, m.width, m.step,
                                                     m.data), args.repeats)
            built_in = f'{ms:.3f}'
        ms = median_ms(lambda m=m: via_bridge(m), args.repeats)
        print(f'| {encoding} | {built_in} | {ms:.3f} |')


if __name__ == '__main__':
    main()
