#!/usr/bin/env python3
"""Factor and second-order storage dtypes: K-FAC memory and accuracy of `dkfac train` on the cnn.

Runs ./build/dkfac train once per (factor dtype, inverse dtype), one after another, and prints a Markdown
table from each run's metrics summary (docs/PRECISION.md keeps the result and the command).
Usage: scripts/dtype_study.py [--epochs N] [--out DIR] [extra train flags...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

VARIANTS = [('float32', 'float32'), ('bfloat16', 'float32'), ('bfloat16', 'bfloat16'), ('float64', 'float64')]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--epochs', type=int, default=2)
    parser.add_argument('--out', default='runs/dtypes')
    args, extra = parser.parse_known_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for factor, inverse in VARIANTS:
        metrics = os.path.join(args.out, f'{factor}-{inverse}.jsonl')
        if os.path.exists(metrics):
            os.remove(metrics)
        command = ['./build/dkfac', 'train', '--epochs', str(args.epochs), '--factor-dtype', factor,
                   '--inv-dtype', inverse, '--metrics', metrics, *extra]
        start = time.time()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        events = [json.loads(line) for line in open(metrics)]
        summary = next(e for e in events if e.get('event') == 'summary')
        epochs = [e for e in events if e.get('event') == 'epoch']
        rows.append((factor, inverse, summary['kfac_memory_bytes'], [e['test_accuracy'] for e in epochs],
                     time.time() - start))
    print('| factors | second order | K-FAC memory | test accuracy after each epoch | wall time |')
    print('|---|---|---|---|---|')
    for factor, inverse, memory, accuracy, wall in rows:
        acc = ' / '.join(f'{100 * a:.2f} %' if a <= 1 else f'{a:.2f} %' for a in accuracy)
        print(f'| {factor} | {inverse} | {memory / 2**20:.2f} MiB | {acc} | {wall:.1f} s |')
    print(f"\ncommand: {' '.join(['scripts/dtype_study.py', '--epochs', str(args.epochs), *extra])}")


if __name__ == '__main__':
    main()
