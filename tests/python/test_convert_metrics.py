"""scripts/convert_metrics.py: metrics files of formats 1 and 2 become format 3 (tools/train/metrics.h), the one
format `dkfac plot` reads; a format 3 file is left as it is."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / 'scripts' / 'convert_metrics.py'
spec = importlib.util.spec_from_file_location('convert_metrics', SCRIPT)
convert_metrics = importlib.util.module_from_spec(spec)
spec.loader.exec_module(convert_metrics)


def write(path: Path, events: list[dict]) -> Path:
    path.write_text(''.join(json.dumps(e) + '\n' for e in events))
    return path


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# Format 1: no run event, 0-based step epochs, no epoch_progress; 4 steps per epoch.
V1 = [{'event': 'step', 'step': 2, 'epoch': 0, 'loss': 1.5, 'wall_time_s': 1.0,
       'kfac_time_s': {'factors': 0.25, 'precondition': 0.5}},
      {'event': 'step', 'step': 4, 'epoch': 0, 'loss': 1.0, 'wall_time_s': 2.0},
      {'event': 'epoch', 'epoch': 1, 'step': 4, 'test_accuracy': 0.6, 'test_loss': 1.1, 'wall_time_s': 2.2,
       'kfac_time_s': 0.75},
      {'event': 'step', 'step': 6, 'epoch': 1, 'loss': 0.7, 'wall_time_s': 3.0}]


def test_format_1_gains_a_run_event_epoch_progress_and_1_based_epochs(tmp_path):
    path = write(tmp_path / 'v1.jsonl', V1)
    assert convert_metrics.main([str(path)]) == 0
    events = read(path)
    assert events[0] == {'event': 'run', 'format_version': 3, 'converted_from': 1}
    steps = [e for e in events if e['event'] == 'step']
    assert [e['epoch_progress'] for e in steps] == [0.5, 1.0, 1.5]  # step / (4 / 1)
    assert [e['epoch'] for e in steps] == [1, 1, 2]
    assert steps[0]['kfac_time_s'] == {'factors': 0.25, 'precondition': 0.5, 'total': 0.75}
    epoch = next(e for e in events if e['event'] == 'epoch')
    assert epoch['kfac_time_s'] == {'total': 0.75}  # its phases were not recorded
    assert {k: v for k, v in epoch.items() if k != 'kfac_time_s'} == {k: v for k, v in V1[2].items()
                                                                       if k != 'kfac_time_s'}
    # Without an epoch event the steps' epoch coordinate is unknown: null, as dkfac plot placed them nowhere.
    steps_only = write(tmp_path / 'steps.jsonl', V1[:2])
    convert_metrics.main([str(steps_only)])
    assert [e.get('epoch_progress', 'absent') for e in read(steps_only)[1:]] == [None, None]


def test_format_2_is_marked_and_its_times_take_format_3s_shape(tmp_path):
    v2 = [{'event': 'run', 'format_version': 2, 'command_line': 'dkfac train'},
          {'event': 'step', 'step': 2, 'epoch': 1, 'epoch_progress': 0.5, 'loss': 1.5, 'wall_time_s': 1.0,
           'kfac_time_s': {'factors': 1.0, 'second_order': 2.0}},
          {'event': 'summary', 'kfac_time_s': 3.0,
           'ranks': [{'rank': 0, 'kfac_time_s': {'factors': 1.0, 'apply': 0.5}}, {'rank': 1}]}]
    path = write(tmp_path / 'v2.jsonl', v2)
    assert convert_metrics.main(['--check', str(path)]) == 1
    assert read(path) == v2, '--check converts nothing'
    assert convert_metrics.main([str(path)]) == 0
    run, step, summary = read(path)
    assert run == {'event': 'run', 'format_version': 3, 'converted_from': 2, 'command_line': 'dkfac train'}
    assert step['kfac_time_s'] == {'factors': 1.0, 'second_order': 2.0, 'total': 3.0}
    assert step['epoch'] == 1 and step['epoch_progress'] == 0.5
    assert summary['kfac_time_s'] == {'total': 3.0}
    assert summary['ranks'] == [{'rank': 0, 'kfac_time_s': {'factors': 1.0, 'apply': 0.5, 'total': 1.5}},
                                {'rank': 1}]
    text = path.read_text()
    assert convert_metrics.main([str(path)]) == 0 and path.read_text() == text, 'a format 3 file stays as it is'
    assert convert_metrics.main(['--check', str(path)]) == 0


def test_every_committed_metrics_file_is_format_3():
    files = sorted(str(p) for p in (SCRIPT.parents[1] / 'docs' / 'perf').rglob('*.jsonl'))
    assert files, 'docs/perf holds metrics files'
    assert convert_metrics.main(['--check', *files]) == 0
