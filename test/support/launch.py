"""What the launch and command-line tests share: whether launch is here, the installed
package, a fast robot file."""
import importlib.util
import pathlib
import sys

import pytest
import yaml

from support.paths import TOOLS

# Stopping a process group the way ros2 launch does: SIGINT, then a kill (tools/hosts.py).
sys.path.insert(0, str(TOOLS))
from hosts import stop  # noqa: E402, F401 (the tests take it from here)

ament = pytest.importorskip('ament_index_python.packages')


HAVE_LAUNCH = all(importlib.util.find_spec(m) is not None
                  for m in ('launch_ros', 'launch.launch_description'))


NO_LAUNCH = ('launch and launch_ros are not installed (PyPI has no ROS 2 launch wheels; '
             'tools/ws.sh builds them when OXYGEN_ROS_OVERLAY_SRC names their sources)')


NO_ROS2 = NO_LAUNCH + ' (or the ros2 command is missing)'


def installed():
    try:
        prefix = pathlib.Path(ament.get_package_prefix('oxygen_ros'))
        share = pathlib.Path(ament.get_package_share_directory('oxygen_ros'))
    except ament.PackageNotFoundError:
        pytest.skip('oxygen_ros is not installed in a colcon workspace (make test)')
    return prefix, share


def tiny_sim_file(folder) -> pathlib.Path:
    """config/sim.yaml on the tiny model with 64x48 images, written into `folder`: a robot
    file the launch tests' nodes start fast on."""
    share = pathlib.Path(ament.get_package_share_directory('oxygen_ros'))
    sim = yaml.safe_load((share / 'config' / 'sim.yaml').read_text())
    # The subtask format: a pi05 prompt with sim.yaml's 8-d state does not fit the tiny
    # model's 24 prompt tokens.
    # Eager: these tests check what launch wires, and a cold compile of the programs (tens of
    # seconds each on two cores; test_node checks the compiled default) held a fleet node
    # inactive past its test's wait in CI.
    sim['/**']['ros__parameters'].update(model='tiny', prompt_format='subtask', image_width=64,
                                         image_height=48, compile=False)
    path = pathlib.Path(folder) / 'sim_tiny.yaml'
    path.write_text(yaml.safe_dump(sim))
    return path
