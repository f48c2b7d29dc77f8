"""A fleet file: which server (GPU host) runs the model for which robots.

    servers:
      gpu_a: [left, right]
      gpu_b: [third]

Each server runs one oxygen_node for its robots, named after the server
(oxygen_node_gpu_a), so two servers on one DDS domain never share a node name and each
robot's ~/ask is /oxygen_node_<server>/<robot>/ask. A standby for a server's robots is
oxygen_node_<server>_standby: it waits unconfigured until it is told to take over. A robot
on two servers would be commanded twice, so that is an error, as is a server with no robots.
Plain Python (no ROS): fleet.launch.py reads it, and so can anything that fills `robots`.
"""

from __future__ import annotations

from pathlib import Path

from oxygen_ros.robot import safe_yaml
from oxygen_ros.robot.params import identifier
from oxygen_ros.robot.safe_yaml import shown


def servers(doc: dict, source: str = 'fleet file') -> dict[str, list[str]]:
    """server -> its robots, from a parsed fleet file; ValueError naming what is wrong."""
    if not isinstance(doc, dict) or not isinstance(doc.get('servers'), dict) or not doc[
            'servers']:
        raise ValueError(f'{source}: needs a `servers` mapping, e.g. '
                         '{servers: {gpu_a: [left, right]}}')
    out: dict[str, list[str]] = {}
    owner: dict[str, str] = {}
    for server, robots in doc['servers'].items():
        if not identifier(server):
            raise ValueError(f'{source}: server {shown(server)} is not a plain name')
        if isinstance(robots, str):
            robots = [robots]
        if not isinstance(robots, list) or not robots:
            raise ValueError(f'{source}: server {server} lists no robots')
        for r in robots:
            if not identifier(r):
                raise ValueError(f'{source}: server {server}: robot {shown(r)} is not a plain '
                                 'name')
            if r in owner:
                raise ValueError(f'{source}: robot {r} is on {owner[r]} and {server}; '
                                 'a robot is commanded by one server')
            owner[r] = server
        out[server] = list(robots)
    return out


def load(path: str | Path) -> dict[str, list[str]]:
    path = Path(path)
    try:
        doc = safe_yaml.read(path)
    except (OSError, ValueError) as e:
        raise ValueError(f'fleet file {path}: {e}') from None
    return servers(doc, f'fleet file {path}')


def robots_of(path: str | Path, server: str) -> list[str]:
    """The robots `server` commands in the fleet file at `path`."""
    table = load(path)
    if server not in table:
        raise ValueError(f'fleet file {path}: no server {server!r} (it has '
                         f'{", ".join(table)})')
    return table[server]


def node_name(server: str, standby: bool = False) -> str:
    if not identifier(server):
        raise ValueError(f'server {server!r} is not a plain name')
    return f'oxygen_node_{server}' + ('_standby' if standby else '')
