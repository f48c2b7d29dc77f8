"""Collection of this directory's test files.

ament runs one pytest per test file (CMakeLists.txt). pytest >= 8 collects a named file by
listing its whole directory, and launch_testing's pytest plugin imports every test_*.py it is
shown to look for a launch description, so each run imported all the test files and what they
import (torch, rclpy, MuJoCo): about 12 s of every file's run, a quarter of the suite's time.
Where only files are named, only those are collected."""
from pathlib import Path


def pytest_ignore_collect(collection_path, config):
    named = [Path(str(a).split('::')[0]).resolve() for a in config.args]
    if named and all(p.is_file() for p in named) and collection_path.suffix == '.py':
        if collection_path.resolve() not in named:
            return True
    return None
