"""tools/skips.py, the skip gate of `make test`, on hand-made JUnit XML shaped like pytest's
and on XML that pytest itself writes."""
import os
import subprocess
import sys

import pytest
from support.paths import ROOT, TOOLS  # noqa: E402

sys.path.insert(0, str(TOOLS))
import skips  # noqa: E402

GPU = 'CUDA is not available'
LAUNCH = 'launch and launch_ros are not installed'


def suite(cases, prefix='oxygen_ros.test.test_a'):
    """A pytest-style results file: cases are (name, None | ('skip'|'fail'|'error', text))."""
    body, n = [], {'skipped': 0, 'failures': 0, 'errors': 0}
    for name, outcome in cases:
        if outcome is None:
            body.append(f'<testcase classname="{prefix}" name="{name}" time="0.1" />')
            continue
        kind, text = outcome
        tag, key = {'skip': ('skipped', 'skipped'), 'fail': ('failure', 'failures'),
                    'error': ('error', 'errors')}[kind]
        n[key] += 1
        body.append(f'<testcase classname="{prefix}" name="{name}" time="0.1"><{tag} '
                    f'type="pytest.skip" message="{text}">/x/test.py:3: {text}</{tag}>'
                    '</testcase>')
    return ('<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests">'
            f'<testsuite name="pytest" errors="{n["errors"]}" failures="{n["failures"]}" '
            f'skipped="{n["skipped"]}" tests="{len(cases)}" time="1.0">'
            + ''.join(body) + '</testsuite></testsuites>')


COLLECTION_SKIP = (
    '<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests"><testsuite '
    'name="pytest" errors="0" failures="0" skipped="1" tests="1" time="0.1"><testcase '
    'classname="oxygen_ros" name="test.test_c" time="0.000"><skipped message="collection '
    'skipped">(\'/x/test/test_c.py\', 19, "Skipped: could not import \'rclpy\': No module '
    'named \'rclpy\'")</skipped></testcase></testsuite></testsuites>')


@pytest.fixture
def results(tmp_path):
    d = tmp_path / 'test_results' / 'oxygen_ros'
    d.mkdir(parents=True)
    (d / 'test_a.xunit.xml').write_text(suite([
        ('test_one', None), ('test_two', None), ('test_gpu', ('skip', GPU))]))
    (d / 'test_b.xunit.xml').write_text(suite([
        ('test_three', None), ('test_launch_file', ('skip', LAUNCH))],
        prefix='oxygen_ros.test.test_b.TestLaunch'))
    return tmp_path / 'test_results'


ALLOW = [('test_a.py::test_gpu', 'CI has no GPU'), ('test_b.py::TestLaunch::*', 'no launch')]


def test_allowed_skips_pass_and_are_listed_with_their_reasons(results):
    lines, ok = skips.check(results, ALLOW, strict='CI=true')
    assert ok
    # Each reason once, its tests under it.
    assert lines == ['== skipped tests: 2',
                     f'  {GPU}:', '    test_a.py::test_gpu [allowed: CI has no GPU]',
                     f'  {LAUNCH}:',
                     '    test_b.py::TestLaunch::test_launch_file [allowed: no launch]',
                     'tests: 3 passed, 0 failed, 2 skipped']


def test_an_unlisted_skip_fails_when_strict_naming_it(results):
    lines, ok = skips.check(results, ALLOW[:1], strict='CI=true')
    assert not ok
    gate = lines.index('== skip gate (CI=true): 1 skipped tests are not on the allow-list:')
    assert lines[gate + 1] == f'  test_b.py::TestLaunch::test_launch_file: {LAUNCH}'
    # The allowed one is listed but not blamed.
    assert not any('test_gpu' in x for x in lines[gate:])
    assert lines[-1] == 'tests: 3 passed, 0 failed, 2 skipped'


def test_unlisted_skips_are_listed_but_pass_when_not_strict(results):
    lines, ok = skips.check(results, [], strict='')
    assert ok
    assert lines[1:5] == [f'  {GPU}:', '    test_a.py::test_gpu',
                          f'  {LAUNCH}:', '    test_b.py::TestLaunch::test_launch_file']
    assert lines[5].startswith('== skip gate: not enforced (2 not on')
    assert lines[-1] == 'tests: 3 passed, 0 failed, 2 skipped'


def test_a_file_skipped_at_collection_is_one_id_with_its_reason(results):
    (results / 'oxygen_ros' / 'test_c.xunit.xml').write_text(COLLECTION_SKIP)
    lines, ok = skips.check(results, ALLOW, strict='CI=true')
    assert not ok
    assert lines[-2] == "  test_c.py: could not import 'rclpy': No module named 'rclpy'"
    assert skips.check(results, [*ALLOW, ('test_c.py', 'why')], strict='CI=true')[1]


def test_many_unlisted_skips_are_counted_per_file(results):
    (results / 'oxygen_ros' / 'test_d.xunit.xml').write_text(suite(
        [(f'test_{i}', ('skip', LAUNCH)) for i in range(12)], prefix='oxygen_ros.test.test_d'))
    lines, ok = skips.check(results, ALLOW[:1], strict='CI=true')
    assert not ok
    assert lines[3:5] == [f'  {LAUNCH}:', '    test_b.py::TestLaunch::test_launch_file']
    assert lines[-3:] == [
        '== skip gate (CI=true): 13 skipped tests are not on the allow-list:',
        '  1 in test_b.py, 12 in test_d.py (each named above under its reason, without '
        '[allowed])',
        'tests: 3 passed, 0 failed, 14 skipped']


def test_failures_missing_results_and_nothing_passed_fail(results):
    d = results / 'oxygen_ros'
    assert not skips.check(results, ALLOW, expect=['test_a', 'test_b', 'test_d'])[1]
    assert skips.check(results, ALLOW, expect=['test_a', 'test_b'])[1]
    (d / 'test_e.xunit.xml').write_text(suite([('test_x', ('fail', 'boom'))]))
    lines, ok = skips.check(results, ALLOW)
    assert not ok and lines[-1] == 'tests: 3 passed, 1 failed, 2 skipped'
    for f in d.iterdir():
        f.unlink()
    (d / 'test_a.xunit.xml').write_text(suite([('test_gpu', ('skip', GPU))]))
    lines, ok = skips.check(results, ALLOW)
    assert not ok and lines[-2:] == ['== no test passed', 'tests: 0 passed, 0 failed, 1 skipped']
    (d / 'test_f.xunit.xml').write_text('<testsuites><testsuite')
    lines, ok = skips.check(results, ALLOW)
    assert not ok and any(x.startswith('== unreadable results: ') for x in lines)


def test_strict_in_ci_or_with_both_tarballs():
    assert skips.strict_reason({'CI': 'true'}) == 'CI=true'
    assert skips.strict_reason({'CI': 'false'}) == ''
    assert skips.strict_reason({}) == ''
    both = {'OXYGEN_ROS_OVERLAY_SRC': '/a.tar.gz', 'OXYGEN_CV_BRIDGE_SRC': '/b.tar.gz'}
    assert skips.strict_reason(both).startswith('OXYGEN_ROS_OVERLAY_SRC and')
    assert skips.strict_reason({'OXYGEN_ROS_OVERLAY_SRC': '/a.tar.gz'}) == ''


def test_allow_list_entries_need_a_reason(tmp_path):
    f = tmp_path / 'skips.txt'
    f.write_text('# comment\n\ntest_a.py::test_gpu   CI has no GPU  # trailing\n')
    assert skips.load_allow(f) == [('test_a.py::test_gpu', 'CI has no GPU')]
    f.write_text('test_a.py::test_gpu\n')
    with pytest.raises(ValueError, match='has no reason'):
        skips.load_allow(f)
    # The repository's own list parses.
    skips.load_allow(ROOT / 'test' / 'skips.txt')


def test_cli_exit_codes_and_output(results, tmp_path):
    allow = tmp_path / 'skips.txt'
    allow.write_text('test_a.py::test_gpu  CI has no GPU\n')
    cmd = [sys.executable, str(ROOT / 'tools' / 'skips.py'), str(results), '--allow', str(allow)]
    env = {k: v for k, v in os.environ.items()
           if k not in ('CI', 'OXYGEN_ROS_OVERLAY_SRC', 'OXYGEN_CV_BRIDGE_SRC')}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines()[-1] == 'tests: 3 passed, 0 failed, 2 skipped'
    out = subprocess.run(cmd, env=dict(env, CI='true'), capture_output=True, text=True)
    assert out.returncode == 1
    assert out.stdout.splitlines()[-3:-1] == [
        f'== skip gate (CI=true): 1 skipped tests are not on {allow}:',
        f'  test_b.py::TestLaunch::test_launch_file: {LAUNCH}']
    assert out.stdout.splitlines()[-1] == 'tests: 3 passed, 0 failed, 2 skipped'


# The XML is pytest's own (junitxml). With the overlay's launch_testing and launch_ros plugins
# loaded, a file that skips at collection ends in "found no collectors" (exit code 4), so
# plugins stay out.
NO_PLUGINS = {'PYTEST_DISABLE_PLUGIN_AUTOLOAD': '1'}


def test_on_what_pytest_writes(tmp_path):
    """Real pytest output, run as ament_cmake_pytest runs it (--junit-prefix): ids and reasons
    of a plain, a class-level parametrised, a dynamic and a collection skip."""
    files = {
        'test_p': ('import pytest\n'
                   'def test_ok(): pass\n'
                   "@pytest.mark.skipif(True, reason='needs a GPU')\n"
                   'def test_gpu(): pass\n'
                   'class TestK:\n'
                   "    @pytest.mark.parametrize('v', [1, 2])\n"
                   '    def test_v(self, v):\n'
                   "        if v == 2: pytest.skip('two is not here')\n"),
        'test_q': "import pytest\npytest.importorskip('no_such_module_here')\n"}
    out_dir = tmp_path / 'results'
    for name, text in files.items():
        (tmp_path / name / 'test').mkdir(parents=True)
        (tmp_path / name / 'test' / f'{name}.py').write_text(text)
        out = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider',
                              f'test/{name}.py', f'--junit-xml={out_dir}/{name}.xunit.xml',
                              '--junit-prefix=oxygen_ros'], cwd=tmp_path / name,
                             capture_output=True, text=True,
                             env=dict(os.environ, PYTEST_ADDOPTS='', **NO_PLUGINS))
        assert out.returncode in (0, 5), out.stdout + out.stderr  # 5: nothing ran (test_q)
    counts, found, broken, stems = skips.read_results(out_dir)
    assert (broken, stems) == ([], {'test_p', 'test_q'})
    assert counts == {'tests': 5, 'errors': 0, 'failures': 0, 'skipped': 3}
    assert sorted(found) == [
        ('test_p.py::TestK::test_v[2]', 'two is not here'),
        ('test_p.py::test_gpu', 'needs a GPU'),
        ('test_q.py', "could not import 'no_such_module_here': No module named "
                      "'no_such_module_here'")]
