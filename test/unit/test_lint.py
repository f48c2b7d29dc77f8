"""Style is checked by `colcon test`: ruff over the package, tests and tools."""
import shutil
import subprocess

import pytest
from support.paths import ROOT  # noqa: E402

root = ROOT


@pytest.mark.skipif(shutil.which('ruff') is None, reason='ruff is not installed (pip install ruff)')
def test_ruff():
    paths = ['oxygen_ros', 'test', 'tools', 'launch', 'setup.py']
    paths = [p for p in paths if (root / p).exists()]
    out = subprocess.run(['ruff', 'check', *paths], cwd=root, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
