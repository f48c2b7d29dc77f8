"""The package's rooms and the one way imports run between them (docs/architecture.md):
model <- engine <- robot <- ros, with sim/ and bench/ on top; only ros/ and sim/ import
rclpy; nothing in the runtime imports sim/ or bench/; no two modules import each other.
Read from the sources' syntax trees, so a function-local import counts too."""

import ast
from pathlib import Path

from support.paths import ROOT  # noqa: E402

PKG = ROOT / 'oxygen_ros'
RANK = {'model': 0, 'engine': 1, 'robot': 2, 'ros': 3, 'sim': 4, 'bench': 4}
ROS_ROOMS = {'ros', 'sim'}


def modules():
    out = {}
    for path in sorted(PKG.rglob('*.py')):
        parts = path.relative_to(PKG.parent).with_suffix('').parts
        name = '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)
        out[name] = path
    return out


def imports(name: str, path: Path) -> set[str]:
    """Every module (of any package) this one imports, as absolute names."""
    here = name.split('.') if path.name == '__init__.py' else name.split('.')[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ''
            if node.level:
                base = '.'.join(here[:len(here) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f'{base}.{a.name}' for a in node.names)
    return found


def room(name: str) -> str | None:
    parts = name.split('.')
    return parts[1] if len(parts) > 1 and parts[1] in RANK else None


MODULES = modules()
GRAPH = {name: {d for d in imports(name, path) if d in MODULES} for name, path in MODULES.items()}


def test_every_module_lives_in_a_room():
    loose = [n for n in MODULES if n != 'oxygen_ros' and room(n) is None]
    assert not loose, f'modules outside model/ engine/ robot/ ros/ sim/ bench/: {loose}'


def test_only_ros_and_sim_import_rclpy():
    users = [n for n, p in MODULES.items()
             if any(i == 'rclpy' or i.startswith('rclpy.') for i in imports(n, p))]
    assert users, 'no module imports rclpy: the check reads nothing'
    assert all(room(n) in ROS_ROOMS for n in users), \
        [n for n in users if room(n) not in ROS_ROOMS]


def test_imports_run_one_way():
    upward = [(a, b) for a, deps in GRAPH.items() for b in deps
              if room(a) and room(b) and room(a) != room(b)
              and (RANK[room(b)] > RANK[room(a)] or room(b) in ('sim', 'bench'))]
    assert not upward, f'imports from a lower room to a higher one: {upward}'


def test_no_two_modules_import_each_other():
    mutual = sorted({tuple(sorted((a, b))) for a, deps in GRAPH.items() for b in deps
                     if a != b and a in GRAPH.get(b, ())})
    assert not mutual, mutual


def test_the_checks_see_imports():
    # The graph is not empty and holds a known edge, so the checks above cannot pass by
    # reading nothing.
    assert 'oxygen_ros.ros.robot_link' in GRAPH['oxygen_ros.ros.node']
    assert 'oxygen_ros.model.pi05' in GRAPH['oxygen_ros.model']
