"""Test processes: parameter files, ROS domains, environments, waiting."""
import os
import random
import time

import yaml


def write_params(path, params):
    path.write_text(yaml.safe_dump({'/**': {'ros__parameters': params}}))
    return str(path)


_domains: set[int] = set()


def new_domain(lo: int = 1, hi: int = 230) -> str:
    """A ROS domain in [lo, hi] that no other test of this run got from here: a module's
    node keeps running while later tests start their own, and two nodes on one domain hear
    each other's topics (a test would count the other node's commands as its own)."""
    free = [d for d in range(lo, hi + 1) if d not in _domains] or list(range(lo, hi + 1))
    d = random.choice(free)
    _domains.add(d)
    return str(d)


def node_env(domain):
    env = dict(os.environ, ROS_DOMAIN_ID=domain, PYTHONUNBUFFERED='1', OMP_NUM_THREADS='1',
               RCUTILS_LOGGING_BUFFERED_STREAM='0')
    env.setdefault('ROS_AUTOMATIC_DISCOVERY_RANGE', 'LOCALHOST')
    return env


def wait_for(pred, timeout, step=0.05):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return pred()


def rate(received, seconds):
    """Messages per second appended to `received` over the next `seconds`."""
    start = len(received)
    time.sleep(seconds)
    return (len(received) - start) / seconds
