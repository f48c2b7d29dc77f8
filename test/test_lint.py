"""Style is checked by `colcon test`: ruff over the package, tests and tools."""
import pathlib
import shutil
import subprocess

import pytest

root = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which('ruff') is None, reason='ruff is not installed (pip install ruff)')
def test_ruff():
    paths = ['oxygen_ros', 'test', 'tools', 'launch', 'setup.py']
    paths = [p for p in paths if (root / p).exists()]
    out = subprocess.run(['ruff', 'check', *paths], cwd=root, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
