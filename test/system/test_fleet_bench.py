"""oxygen-bench --robots: fleet, sliced and separate at each K, each in its own process."""
import csv
import json
import math

import pytest

from oxygen_ros.bench import engine as bench
from oxygen_ros.model import load_config


def kv_row_bytes(cfg, max_len):
    """One KV row of the tiny model in fp32: keys and values of every layer, the valid
    mask, the length and next position."""
    e = cfg.vlm
    return 2 * e.depth * e.kv_heads * max_len * e.head_dim * 4 + max_len + 2 * 8


def test_robots_path(tmp_path, capsys):
    T, k, rounds = 4, 2, 3
    report = bench.run(['--config', 'tiny', '--robots', '1', '2', '--T', str(T), '--k', str(k),
                        '--frames', str(rounds), '--warmup', '1', '--repeats', '2',
                        '--threads', '1', '--out', str(tmp_path)])
    rows = {(r['mode'], r['robots']): r for r in report['rows']}
    assert report['fresh'] and set(rows) == {(m, n) for m in ('fleet', 'sliced', 'separate')
                                              for n in (1, 2)}
    cfg = load_config('tiny')
    for (mode, n), r in rows.items():
        assert r['rounds'] == rounds
        assert r['action_hz'] == pytest.approx(n * cfg.action_horizon * 1e3 / r['round_ms_mean'])
        assert 0 < r['latency_ms_p50'] <= r['latency_ms_p99']
        # EOS off, one request per robot per round, T tokens each: after the first round
        # every round emits T per robot, whichever way the frames are cut.
        assert r['tokens'] == n * T * rounds, (mode, n)
        assert r['engines'] == (n if mode == 'separate' else 1)
        assert r['robots_per_frame'] == (n if mode == 'fleet' else 1)
        assert 0 < r['rss_start_mb'] <= r['rss_peak_mb']  # its own process's peak
        assert ('phases' in r) == (mode == 'fleet')
    # Weights and KV held: K copies for separate; one model and a pool of K robots' rows
    # (and one scratch row per robot a frame) for the fleet.
    assert rows['separate', 2]['held_mb'] == pytest.approx(2 * rows['separate', 1]['held_mb'])
    per_robot = math.ceil(T / k) + 1
    row = kv_row_bytes(cfg, cfg.prefix_len + T) / 2**20
    assert rows['fleet', 2]['held_mb'] - rows['fleet', 1]['held_mb'] == pytest.approx(
        (per_robot + 1) * row)
    assert rows['sliced', 2]['held_mb'] - rows['sliced', 1]['held_mb'] == pytest.approx(
        per_robot * row)
    ph = rows['fleet', 2]['phases']
    assert ph['rounds'] == 2 and ph['ratio'] == pytest.approx(ph['singles_ms'] / ph['batched_ms'])
    assert rows['fleet', 2]['vs_sliced'] == pytest.approx(
        rows['fleet', 2]['action_hz'] / rows['sliced', 2]['action_hz'])

    saved = json.loads((tmp_path / 'fleet.json').read_text())
    assert saved['config'] == 'tiny' and len(saved['rows']) == 6
    with open(tmp_path / 'fleet.csv') as f:
        table = list(csv.DictReader(f))
    assert len(table) == 6 and {'mode', 'robots', 'action_hz', 'latency_ms_p99'} <= set(table[0])
    printed = capsys.readouterr().out
    assert '| fleet | 2 | 4 |' in printed and 'batching allows' in printed
    assert (tmp_path / 'fleet.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert f'wrote {tmp_path / "fleet.json"}, {tmp_path / "fleet.csv"}, ' in printed
