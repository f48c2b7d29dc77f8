"""oxygen-bench end to end on the tiny model: every mode and T measured, files written."""
import csv
import json
import os
import shutil
import subprocess
import sys

import torch
from support.paths import ROOT  # noqa: E402

from oxygen_ros.bench import engine as bench

torch.set_num_threads(1)


def test_bench_writes_json_csv_png(tmp_path, capsys):
    report = bench.run(['--config', 'tiny', '--T', '2', '4', '--k', '2', '--frames', '3',
                         '--warmup', '1', '--repeats', '2', '--threads', '1',
                         '--out', str(tmp_path)])
    rows = report['results']
    assert sorted((r['mode'], r['T']) for r in rows) == sorted(
        (m, t) for m in bench.MODES for t in (2, 4))
    for r in rows:
        # EOS is off and one request starts per frame: tokens per frame are bounded by T.
        assert 0 < r['frame_ms_p50'] <= r['frame_ms_p99']
        assert abs(r['action_hz'] - 4 * 1000.0 / r['frame_ms_mean']) < 1e-6  # horizon 4
        if r['mode'] != 'parallel':
            # The sum of the frame's phases, by the README's formulas, from the phases
            # timed once after each of its measured frames.
            ph = r['phases']
            assert ph['rounds'] == 3
            # Decoding timed as the frame runs it: T steps at batch 1, or k = 2 at the batch
            # that T tokens at 2 a frame make.
            assert ph['runs'] == ({1: r['T']} if r['mode'] != 'oxygen' else
                                  {min(r['T'] // 2, 2): 2})
            want = {'isolated': 2 * ph['prefill_ms'], 'shared_kv': ph['prefill_ms'],
                    'oxygen': ph['prefill_ms']}[r['mode']] + ph['denoise_ms']
            want += r['T'] * ph['decode_ms'][1] if r['mode'] != 'oxygen' \
                else 2 * ph['decode_ms'][min(r['T'] // 2, 2)]
            assert abs(r['phase_ms'] - want) < 1e-9
        if r['mode'] == 'oxygen':
            iso = next(x for x in rows if x['mode'] == 'isolated' and x['T'] == r['T'])
            assert abs(r['phase_ratio'] - iso['phase_ms'] / r['phase_ms']) < 1e-12
        if r['mode'] == 'isolated':
            assert r['speedup'] == 1.0
            assert r['tokens'] == r['T'] * 3  # every request decoded to the end in-frame
    saved = json.loads((tmp_path / 'bench.json').read_text())
    assert saved['config'] == 'tiny' and len(saved['results']) == 8
    assert set(saved['phases']['decode_ms']) >= {'1', '2'}
    assert saved['phases']['rounds'] == 2
    assert saved['phases']['runs'] == {'1': 2, '2': 2, '3': 2}
    with open(tmp_path / 'bench.csv') as f:
        table = list(csv.DictReader(f))
    assert len(table) == 8 and {'mode', 'T', 'action_hz', 'tokens_per_s'} <= set(table[0])
    assert (tmp_path / 'bench.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    printed = capsys.readouterr().out
    assert '| oxygen | 4 |' in printed and 'oxygen T=4: frame ' in printed


def test_installed_console_script_exits_0(tmp_path):
    """`pip install .` then `oxygen-bench`: the entry point's exit status is main()'s return
    value, so a successful run must exit 0 with nothing on stderr but progress bars."""
    root = ROOT
    # A copy, so pip's build files do not land in the repository (its build/ is colcon's).
    src = tmp_path / 'src'
    shutil.copytree(root / 'oxygen_ros', src / 'oxygen_ros',
                    ignore=shutil.ignore_patterns('__pycache__'))
    shutil.copy(root / 'setup.py', src)
    prefix = tmp_path / 'prefix'
    subprocess.run([sys.executable, '-m', 'pip', 'install', '-q', '--no-deps',
                    '--no-build-isolation', '--prefix', str(prefix), str(src)], check=True)
    exe = prefix / 'bin' / 'oxygen-bench'
    site = next(prefix.glob('lib/python*/site-packages'))
    env = dict(os.environ, OMP_NUM_THREADS='1',
               PYTHONPATH=os.pathsep.join([str(site), os.environ.get('PYTHONPATH', '')]))
    out = tmp_path / 'out'
    done = subprocess.run([str(exe), '--config', 'tiny', '--frames', '2', '--warmup', '0',
                           '--T', '5', '--repeats', '1', '--threads', '1', '--out', str(out),
                           ], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "{'config'" not in done.stderr  # the report is not printed as an exit message
    assert '| oxygen | 5 |' in done.stdout
    report = json.loads((out / 'bench.json').read_text())
    assert report['config'] == 'tiny' and len(report['results']) == len(bench.MODES)
    # The installed copy ran, not the sources or the colcon install space.
    probe = subprocess.run([sys.executable, '-c', 'import oxygen_ros; print(oxygen_ros.__file__)'],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    assert probe.stdout.strip().startswith(str(site)), probe.stdout
