#!/usr/bin/env python3
"""Converts `dkfac train` metrics files of formats 1 and 2 to format 3 (tools/train/metrics.h), in place.

`dkfac plot` reads format 3 only; this converts the older files once:

* format 1 (no run event): a run event `{"event": "run", "format_version": 3, "converted_from": 1}` is put
  first; each step event's 0-based `epoch` becomes 1-based, and it gains `epoch_progress` = step /
  steps_per_epoch, with steps_per_epoch from the first epoch event (its `step` / its `epoch`; null when the file
  has no epoch event, as `dkfac plot` placed no such step on the epoch axis);
* format 2: the run event's `format_version` becomes 3, with `"converted_from": 2`;
* both: `kfac_time_s` takes format 3's one shape. A per-phase object without `"total"` (step events, the
  summary's ranks[]) gains the phases' sum as `"total"`; a number (format 2's epoch and summary events: the total
  alone) becomes `{"total": number}`, since its phases were not recorded.

Every other field is kept as it was. Lines are written as `dkfac train` writes them: compact JSON, keys sorted.
A file already in format 3 is left unchanged, so running it twice is harmless.

    python3 scripts/convert_metrics.py docs/perf/tta/*.jsonl docs/perf/torch-2.11/tta/*.jsonl
    python3 scripts/convert_metrics.py --check FILE...   # exit 1, naming them, if any file needs converting
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

FORMAT = 3


def file_format(events: list[dict[str, Any]]) -> int:
    """The file's format: its run event's format_version (a format 1 file has no run event)."""
    for event in events:
        if event.get('event') == 'run':
            return int(event.get('format_version', 1))
    return 1


def kfac_time(value: Any) -> Any:
    """kfac_time_s in format 3's shape: the per-phase object with its total."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return {'total': value}
    if isinstance(value, dict) and 'total' not in value:
        return {**value, 'total': sum(v for v in value.values() if isinstance(v, (int, float)))}
    return value


def convert(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events of a format 1 or 2 file as format 3 writes them (a format 3 file: unchanged)."""
    version = file_format(events)
    if version >= FORMAT:
        return events
    out = []
    if version == 1:
        out.append({'event': 'run', 'format_version': FORMAT, 'converted_from': 1})
        first_epoch = next((e for e in events if e.get('event') == 'epoch' and e.get('epoch', 0) > 0
                            and e.get('step', 0) > 0), None)
        steps_per_epoch = first_epoch['step'] / first_epoch['epoch'] if first_epoch else None
    for event in events:
        event = dict(event)
        kind = event.get('event')
        if kind == 'run':
            event['format_version'] = FORMAT
            event['converted_from'] = version
        if version == 1 and kind == 'step' and 'epoch_progress' not in event:
            event['epoch'] = event.get('epoch', 0) + 1
            event['epoch_progress'] = event['step'] / steps_per_epoch if steps_per_epoch else None
        if 'kfac_time_s' in event:
            event['kfac_time_s'] = kfac_time(event['kfac_time_s'])
        if isinstance(event.get('ranks'), list):
            event['ranks'] = [dict(r, kfac_time_s=kfac_time(r['kfac_time_s'])) if 'kfac_time_s' in r else r
                              for r in event['ranks']]
        out.append(event)
    return out


def read(path: Path) -> list[dict[str, Any]]:
    events = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise SystemExit(f'{path}:{number}: not JSON ({error}); nothing was converted') from None
    return events


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('files', nargs='+', type=Path)
    parser.add_argument('--check', action='store_true', help='convert nothing; exit 1 if any file needs it')
    args = parser.parse_args(argv)
    stale = []
    for path in args.files:
        events = read(path)
        version = file_format(events)
        if version >= FORMAT:
            continue
        stale.append(path)
        if args.check:
            print(f'{path}: format {version}', file=sys.stderr)
            continue
        text = ''.join(json.dumps(e, sort_keys=True, separators=(',', ':')) + '\n' for e in convert(events))
        path.write_text(text)
        print(f'{path}: format {version} -> {FORMAT}')
    return 1 if args.check and stale else 0


if __name__ == '__main__':
    sys.exit(main())
