"""tools/gpu_check.sh --cpu end to end on the tiny model: every step runs, the files agree."""
import json
import os
import subprocess
import sys

from support.paths import ROOT  # noqa: E402

root = ROOT


def test_gpu_check_cpu_writes_its_tables(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS='1')
    out = subprocess.run(
        [str(root / 'tools' / 'gpu_check.sh'), '--cpu', '--config', 'tiny',
         '--precision-config', 'tiny', '--T', '2', '4', '--frames', '3', '--warmup', '1',
         '--repeats', '2', '--threads', '1', '--robots', '1', '2', '--out', str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads((tmp_path / 'gpu_check.json').read_text())
    assert report['device'] == 'cpu' and report['config'] == 'tiny'
    # Step 1: graphs and eager agree exactly in tokens, to fp32 rounding in actions.
    prec = report['precision']
    assert prec['ok'] and prec['graphs_vs_eager']['tokens_identical']
    assert prec['graphs_vs_eager']['action_rel'] < 1e-5
    assert 0 < prec['bf16_vs_fp32']['action_max_abs'] < 0.05  # bf16 is not fp32, but near
    # Step 2: 1-3 views, eager and graphs.
    assert sorted((r['graphs'], r['cameras']) for r in report['single']) == [
        (g, c) for g in (False, True) for c in (1, 2, 3)]
    # Step 3: the bench with graphs at every T and the k sweep, eager at the largest T.
    g, e = report['bench_graphs'], report['bench_eager']
    assert g['graphs'] and not e['graphs']
    assert sorted((r['mode'], r['T']) for r in g['results']) == sorted(
        (m, t) for m in ('isolated', 'shared_kv', 'oxygen') for t in (2, 4))
    assert [r['T'] for r in e['results']] == [4, 4, 4]
    assert [r['k'] for r in g['k_sweep']][-1] == 'adaptive'
    # Step 4: the fleet bench at each K, with graphs, at the largest T.
    f = report['fleet']
    assert f['graphs'] and sorted((r['mode'], r['robots']) for r in f['rows']) == sorted(
        (m, k) for m in ('fleet', 'sliced', 'separate') for k in (1, 2))
    assert {r['T'] for r in f['rows']} == {4}
    # Step 5: no energy counter on a CPU, and the report says why rather than a number.
    assert report['energy'] == [] and report['energy_why'] == 'not a CUDA device'
    assert not any('energy_mj_per_frame' in r for r in g['results'])
    md = (tmp_path / 'gpu_check.md').read_text()
    assert md in out.stdout and '| graphs | 3 |' in md and '| oxygen | 4 |' in md
    assert '| fleet | 2 | 4 |' in md and 'energy: not measured (not a CUDA device)' in md
