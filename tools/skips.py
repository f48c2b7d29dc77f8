"""The skip gate of `make test`: every skipped test and its reason, read from the JUnit XML
files `colcon test` writes (one per test file), then the closing count line.

    python tools/skips.py RESULTS [--allow FILE] [--expect TEST_DIR] [--strict]

A skip is a test that did not run, so a build that lost a dependency can look green. In
strict mode (--strict, CI=true, or both OXYGEN_ROS_OVERLAY_SRC and OXYGEN_CV_BRIDGE_SRC set:
then everything the tests need is meant to be there) a skipped test fails the run unless the
allow-list names it. Always failing: a failed test, no passed test, a results file that does
not parse, and (--expect) a test file without a results file.

The allow-list holds one entry a line, `PATTERN  REASON`: PATTERN is an fnmatch pattern over
test ids, REASON (required) says why the test may skip in CI; '#' starts a comment. A test
id is `test_x.py::test_name` (`test_x.py::Class::test_name[param]`), or `test_x.py` when the
whole file skipped at collection (pytest.importorskip at module level).
"""

import argparse
import ast
import fnmatch
import os
import pathlib
import sys
import xml.etree.ElementTree as ET

COUNTS = ('tests', 'errors', 'failures', 'skipped')
MAX_NAMED = 10  # more unlisted skips than this are counted per file, not named again


def file_stem(path: pathlib.Path) -> str:
    name = path.name
    for ext in ('.xunit.xml', '.xml'):
        if name.endswith(ext):
            return name[:-len(ext)]
    return name


def test_id(stem: str, case: ET.Element, collection: bool) -> str:
    if collection:
        return f'{stem}.py'
    # classname is the junit prefix, the file's dotted path, then any classes.
    parts = case.get('classname', '').split('.')
    classes = parts[parts.index(stem) + 1:] if stem in parts else []
    return '::'.join([f'{stem}.py', *classes, case.get('name', '?')])


def skip_reason(el: ET.Element) -> tuple[str, bool]:
    """(reason, whether the whole file skipped at collection)."""
    message = el.get('message', '')
    text = (el.text or '').strip()
    if message == 'collection skipped':
        # The text is the repr of (path, line, 'Skipped: reason').
        try:
            reason = str(ast.literal_eval(text)[-1])
        except (ValueError, SyntaxError, TypeError, IndexError):
            reason = text
        return reason.removeprefix('Skipped: '), True
    return message or text or '(no reason given)', False


def read_results(results: pathlib.Path):
    """Counts summed over every file (as `colcon test-result` sums them), the skipped tests as
    (id, reason), the files that do not parse, and the stems of the files read."""
    counts = dict.fromkeys(COUNTS, 0)
    skips, broken, stems = [], [], set()
    for path in sorted(results.rglob('*.xml')):
        stem = file_stem(path)
        try:
            root = ET.parse(path).getroot()
        except ET.ParseError as e:
            broken.append(f'{path}: {e}')
            continue
        stems.add(stem)
        suites = [root] if root.tag == 'testsuite' else root.iter('testsuite')
        for suite in suites:
            for k in COUNTS:
                counts[k] += int(suite.get(k, 0) or 0)
            for case in suite.iter('testcase'):
                el = case.find('skipped')
                if el is not None:
                    reason, collection = skip_reason(el)
                    skips.append((test_id(stem, case, collection), reason))
    return counts, skips, broken, stems


def load_allow(path: pathlib.Path) -> list[tuple[str, str]]:
    entries = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split('#', 1)[0].strip()
        if not line:
            continue
        parts = line.split(None, 1)
        if len(parts) < 2:
            raise ValueError(f'{path}:{n}: {parts[0]!r} has no reason (PATTERN  REASON)')
        entries.append((parts[0], parts[1].strip()))
    return entries


def strict_reason(env) -> str:
    """Why skips must be allowed, or '' when they need not be."""
    if env.get('CI', '').strip().lower() in ('true', '1', 'yes'):
        return 'CI=true'
    if env.get('OXYGEN_ROS_OVERLAY_SRC') and env.get('OXYGEN_CV_BRIDGE_SRC'):
        return 'OXYGEN_ROS_OVERLAY_SRC and OXYGEN_CV_BRIDGE_SRC are set'
    return ''


def allowed_by(test: str, allow: list[tuple[str, str]]) -> str | None:
    for pattern, reason in allow:
        if fnmatch.fnmatchcase(test, pattern):
            return reason
    return None


def check(results: pathlib.Path, allow: list[tuple[str, str]], strict: str = '',
          expect: list[str] = (), allow_name: str = 'the allow-list') -> tuple[list[str], bool]:
    """The lines to print (the count line last) and whether the run passes."""
    counts, skips, broken, stems = read_results(results)
    lines, ok = [], True
    lines.append(f'== skipped tests: {len(skips) or "none"}')
    by_reason = {}  # the tests of each reason, in the order met
    for test, reason in skips:
        by_reason.setdefault(reason, []).append(test)
    unlisted = []
    for reason, tests in by_reason.items():
        lines.append(f'  {reason}:')
        for test in tests:
            why = allowed_by(test, allow)
            lines.append(f'    {test}' + (f' [allowed: {why}]' if why else ''))
            if why is None:
                unlisted.append((test, reason))
    if unlisted and strict:
        ok = False
        lines.append(f'== skip gate ({strict}): {len(unlisted)} skipped tests are not on '
                     f'{allow_name}:')
        if len(unlisted) <= MAX_NAMED:
            lines += [f'  {test}: {reason}' for test, reason in unlisted]
        else:
            # The list above names each one under its reason.
            files = {}
            for test, _ in unlisted:
                f = test.split('::')[0]
                files[f] = files.get(f, 0) + 1
            lines.append('  ' + ', '.join(f'{n} in {f}' for f, n in files.items()) +
                         ' (each named above under its reason, without [allowed])')
    elif unlisted:
        lines.append(f'== skip gate: not enforced ({len(unlisted)} not on {allow_name}; '
                     'CI=true or both OXYGEN_ROS_OVERLAY_SRC and OXYGEN_CV_BRIDGE_SRC '
                     'enforce it)')
    for b in broken:
        ok = False
        lines.append(f'== unreadable results: {b}')
    missing = sorted(set(expect) - stems)
    if missing:
        ok = False
        lines.append(f'== no results from: {", ".join(m + ".py" for m in missing)}')
    failed = counts['errors'] + counts['failures']
    passed = counts['tests'] - failed - counts['skipped']
    if failed:
        ok = False
    if passed <= 0:
        ok = False
        lines.append('== no test passed')
    lines.append(f'tests: {passed} passed, {failed} failed, {counts["skipped"]} skipped')
    return lines, ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('results', type=pathlib.Path, help='folder holding the JUnit XML files')
    p.add_argument('--allow', type=pathlib.Path, help='the allow-list file')
    p.add_argument('--expect', type=pathlib.Path,
                   help='folder of test_*.py files that must each have a results file')
    p.add_argument('--strict', action='store_true', help='enforce the allow-list here too')
    args = p.parse_args(argv)
    try:
        allow = load_allow(args.allow) if args.allow else []
    except (OSError, ValueError) as e:
        print(f'tools/skips.py: bad allow-list: {e}', flush=True)
        return 2
    strict = 'strict' if args.strict else strict_reason(os.environ)
    # The test files of every tier (test/<tier>/test_*.py), and any left at the top.
    expect = sorted(f.stem for f in [*args.expect.glob('test_*.py'),
                                     *args.expect.glob('*/test_*.py')]) if args.expect else []
    lines, ok = check(args.results, allow, strict, expect,
                      str(args.allow) if args.allow else 'the allow-list')
    print('\n'.join(lines), flush=True)
    return 0 if ok else 1


if __name__ == '__main__':
    sys.exit(main())
