"""A shipped robot file's contract, as the node checks it at configure."""
import yaml

from oxygen_ros.robot.contract import Config
from oxygen_ros.robot.params import flatten
from support.paths import CONFIG


def robot_config(name: str, **values) -> Config:
    """config/<name>'s robot parameters (flattened as ROS reads them), with `values` on top."""
    tree = yaml.safe_load((CONFIG / name).read_text())['/**']['ros__parameters']
    return Config.from_values({**flatten(tree), **values})
