"""ask_bench end to end on the tiny model: both ways of asking are timed and the questions
kept in flight are really decoded (no timing is asserted)."""
import json

from oxygen_ros.bench import ask as ask_bench


def test_ask_bench_runs_and_keeps_questions_in_flight(tmp_path):
    report = ask_bench.main(['--config', 'tiny', '--device', 'cpu', '--threads', '1',
                             '--frames', '3', '--warmup', '1', '--repeats', '1',
                             '--T', '6', '--k', '2', '--out', str(tmp_path)])
    assert json.loads((tmp_path / 'ask_bench.json').read_text()) == report
    short, long = report['question_costs']
    assert short['question_tokens'] < long['question_tokens']
    for c in (short, long):
        assert all(c[k] > 0 for k in ('prefill_ms', 'extension_ms', 'second_prefill_ms'))
    runs = {r['questions']: r for r in report['in_flight']}
    assert sorted(runs) == [0, 1, 4]
    assert runs[0]['question_tokens_per_s'] == 0 and runs[0]['questions_started'] == 0
    for n in (1, 4):
        # T = 6 at k = 2: a question lives 3 frames, so 3 measured frames start new ones.
        assert runs[n]['question_tokens_per_s'] > 0 and runs[n]['questions_started'] >= n
    # 6 / 2 + 1 narration rows and the most questions.
    assert report['max_requests'] == 3 + 1 + 4
