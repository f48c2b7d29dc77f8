"""Point the ROS message wheels' CMake exports at this interpreter's include directories.

The wheels record the include paths of the machine that built them (a manylinux image); CMake
refuses a target whose include directory does not exist, so every package that generates
Python message bindings against them would fail to configure.
"""
import pathlib
import re
import sys
import sysconfig

import numpy

python_inc = sysconfig.get_paths()['include']
numpy_inc = numpy.get_include()


def fix(path: pathlib.Path) -> bool:
    text = path.read_text()

    def repl(match: re.Match) -> str:
        dirs = []
        for d in match.group(1).split(';'):
            if d and not pathlib.Path(d).exists():
                d = numpy_inc if 'numpy' in d else python_inc
            dirs.append(d)
        joined = ';'.join(dirs)
        return f'INTERFACE_INCLUDE_DIRECTORIES "{joined}"'

    new = re.sub(r'INTERFACE_INCLUDE_DIRECTORIES "([^"]*)"', repl, text)
    if new != text:
        path.write_text(new)
        return True
    return False


def main() -> None:
    prefix = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else sys.prefix)
    files = list(prefix.glob('share/*/cmake/export_*__rosidl_generator_pyExport.cmake'))
    changed = sum(fix(f) for f in files)
    print(f'fixed include paths in {changed} of {len(files)} CMake export files')


if __name__ == '__main__':
    main()
