"""Where the package's installed files are: robot files, launch configs, shipped models."""

from __future__ import annotations

from pathlib import Path


def config_dir() -> Path:
    try:
        from ament_index_python.packages import get_package_share_directory

        return Path(get_package_share_directory('oxygen_ros')) / 'config'
    except Exception:  # not installed with colcon: use the source tree
        return Path(__file__).resolve().parents[2] / 'config'


def shipped_policy() -> Path:
    """The checkpoint the package ships: pi0.5 trained on scripted transfer-cube
    demonstrations of the MuJoCo ALOHA (its README is the model card)."""
    return config_dir().parent / 'models' / 'aloha_sim_transfer_cube'
