"""What every tier's tests share: collection, a ROS domain per module, a LeRobot policy's
weights. The tiers: unit/ (plain Python, no ROS node), reference/ (against openpi's, LeRobot's
and DROID's own code or numbers), ros/ (oxygen_node over rclpy), system/ (launch, the ros2
command line, hosts, MuJoCo, training, evaluation, benchmarks end to end). Shared helpers
are in support/.

Collection.
ament runs one pytest per test file (CMakeLists.txt). pytest >= 8 collects a named file by
listing its whole directory, and launch_testing's pytest plugin imports every test_*.py it is
shown to look for a launch description, so each run imported all the test files and what they
import (torch, rclpy, MuJoCo): about 12 s of every file's run, a quarter of the suite's time.
Where only files are named, only those are collected.

Lanes.
CMakeLists.txt runs the files in two lanes side by side; the compute lane's files run at the
priority OXYGEN_TEST_NICE gives (19: the lowest), and every process they start inherits it."""
import os
from pathlib import Path

import pytest
from support.process import new_domain

NICE = int(os.environ.get('OXYGEN_TEST_NICE') or 0)
if NICE:
    os.nice(NICE)


def pytest_ignore_collect(collection_path, config):
    named = [Path(str(a).split('::')[0]).resolve() for a in config.args]
    if named and all(p.is_file() for p in named) and collection_path.suffix == '.py':
        if collection_path.resolve() not in named:
            return True
    return None


@pytest.fixture(scope='module')
def domain():
    """A ROS domain of the module's own: other test runs on this machine use the same topic
    names, and a module's node keeps running while later tests start their own. 1..101:
    on Linux, higher domains put DDS ports into the ephemeral range (ROS 2's domain ID
    notes)."""
    return new_domain(1, 101)


@pytest.fixture(scope='module')
def weights(tmp_path_factory):
    """A LeRobot pi05 policy's model.safetensors (support/lerobot.py)."""
    from support.lerobot import lerobot_weights

    return lerobot_weights(tmp_path_factory.mktemp('w'))
