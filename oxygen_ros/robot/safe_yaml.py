"""YAML as the node reads it from files and parameters: bounded, and with one error type.

yaml.safe_load expands nothing by itself, but an alias (*name) shares a node, so a small
text can describe a tree of billions of leaves that flattening, checking or printing then
walks (the billion laughs); ROS's own params file parser (rcl_yaml_param_parser) refuses
aliases, and so does this. Text nested past the parser's recursion, dates that are not
dates (2001-02-30), undecodable bytes and texts over MAX_BYTES are ValueErrors too, never
another exception. Plain Python: the launch files use it through fleet_file.
"""

from __future__ import annotations

import re
import reprlib

import yaml

# A robot file or fleet file is a few kB; a parameter value a line.
MAX_BYTES = 1 << 20
# Flow collections ([...], {...}) nested deeper than this are refused before parsing:
# PyYAML's scanner takes time in the square of their depth (20000 '[' take seconds) and its
# composer recurses into them.
MAX_NESTING = 64
_BRACKETS = re.compile(r'[\[\]{}]'), re.compile(rb'[\[\]{}]')


class _Loader(yaml.SafeLoader):
    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise yaml.composer.ComposerError(
                None, None, 'aliases (*name) are not taken, as in ROS params files', mark)
        return super().compose_node(parent, index)


def load(text: str | bytes) -> object:
    """The value of a YAML document, or ValueError saying why there is none."""
    if len(text) > MAX_BYTES:
        raise ValueError(f'{len(text)} bytes of YAML, over the {MAX_BYTES} taken')
    if _nesting(text) > MAX_NESTING:
        raise ValueError(f'YAML nested more than {MAX_NESTING} brackets deep')
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as e:
        raise ValueError(f'not YAML: {e}') from None
    except RecursionError:
        raise ValueError('YAML nested too deeply') from None
    except (ValueError, OverflowError, AttributeError, TypeError) as e:
        # PyYAML's constructors on a value their tag does not fit: 2001-02-30 (ValueError),
        # '!!timestamp 99999-01-01' (AttributeError: its pattern did not match).
        raise ValueError(f'not YAML: {type(e).__name__}: {e}') from None


def _nesting(text: str | bytes) -> int:
    """How deep the brackets of `text` nest, quoted ones counted too (more than
    MAX_NESTING of those is not a parameter either)."""
    depth = most = 0
    for b in _BRACKETS[isinstance(text, bytes)].findall(text):
        if b in ('[', '{', b'[', b'{'):
            depth += 1
            most = max(most, depth)
        else:
            depth = max(0, depth - 1)
    return most


def read(path) -> object:
    """The YAML document of the file at `path`: OSError when it cannot be read, ValueError
    as for load."""
    with open(path, 'rb') as f:
        text = f.read(MAX_BYTES + 1)
    return load(text)


_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 80
_repr.maxlist = _repr.maxtuple = _repr.maxdict = _repr.maxset = 8
_repr.maxlevel = 3


def shown(value) -> str:
    """repr(value) cut short for a message: a value read from a file may be long."""
    return _repr.repr(value)
