#!/usr/bin/env python3
"""K-FAC + AdamW against tuned AdamW on a small Hugging Face GPT-2, trained on the Python standard library's sources.

Issues 36 and 45: does K-FAC reach AdamW's best validation loss in at most 0.75x AdamW's wall time?

Run it (from the repository root; dkfac from a built tree, transformers in the environment)::

    PYTHONPATH=build/python .venv/bin/python bench/transformer_vs_adamw.py [--quick] [--out DIR]

If ``import dkfac`` fails, ``build/python`` of this repository is put on ``sys.path``. HF_HUB_OFFLINE=1 is set:
the model is built from a ``GPT2Config`` (random initialisation), nothing is downloaded.

Corpus: every ``*.py`` file under ``sysconfig.get_paths()['stdlib']`` (sorted by path; directories named
``test``, ``tests``, ``idle_test``, ``site-packages`` and ``__pycache__`` skipped; at most ``--max-bytes`` in
path order), as bytes: vocabulary 256, one token per byte, files joined by a NUL byte (token 0, which the
sources do not contain; any NUL inside a file is kept as it is). Split by file: every 10th file (index 9, 19,
... in sorted order) is validation, the rest training. Training batches are random windows of the training
tokens, drawn from a generator seeded with the run's seed (so every optimizer of a seed sees the same batches);
the validation loss is the mean next-byte cross entropy (nats) over a fixed subset of validation windows
(``--val-windows`` windows at evenly spaced offsets), evaluated every ``--eval-every`` steps and at the end.

Model: ``transformers.GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=128, ...))``, no dropout,
tied input/output embeddings by default (``--untied`` unties them); dkfac leaves tied weights to the base
optimizer with a warning, so the 256 x n_embd embedding/head is AdamW's either way unless untied.

Optimizers (all with the same parameter groups: weight decay on matrices only, and the same schedule shape:
linear warm-up over ``--warmup-steps`` steps (60; the same for a shortened schedule), then cosine decay to 10% of the
peak lr at the run's last step):

* ``adamw``: ``torch.optim.AdamW`` (betas 0.9, 0.95), lr swept over ``--adamw-lrs`` on the tuning seed; the lr
  with the lowest best validation loss is kept;
* ``kfac_adamw``: ``dkfac.optim.KFAC(model, AdamW(...), factor_update_steps, inv_update_steps, damping,
  kl_clip)`` (the preconditioner's lr follows the AdamW lr); a few (lr, damping, intervals, schedule length)
  configurations are tried on the tuning seed and the one that reaches the AdamW target soonest is kept;
* grafted ``kfac_adamw`` (``--kfac-graft-configs``): the same with ``graft=True``: each layer moves along
  K-FAC's direction by the length of AdamW's own step (docs/PYTHON.md, "Grafting"); chosen like the others;
* Adam in the K-FAC eigenbasis (``--kfac-eigen-adam-configs``): ``dkfac.optim.KFAC(..., eigen_adam=True)``: the
  K-FAC layers take Adam's step in their eigenbasis (AdamW's betas and eps, lr and decay), the rest AdamW's
  (docs/MATH.md section 8); chosen like the others;
* ``kfac_sgd``: ``dkfac.optim.KFAC(model, SGD(momentum 0.9))``, tuning seed only, when ``--kfac-sgd-configs``
  names any (none by default: on 400-step schedules it ended far behind AdamW, see docs/PERFORMANCE.md).

Schedule of the run (``docs/PERFORMANCE.md`` explains why): all runs of one seed train in lockstep in this
one process: one step of each run in turn (the order rotating every step), so that the load of the machine (a
C++ build running beside it) falls on every optimizer alike. Phase 1 (tuning): seed 0, every candidate.
Phase 2 (headline): seeds 1..N, the chosen AdamW and the chosen K-FAC + AdamW; the headline medians are over
the seeds 0..N (seed 0 from phase 1 included and marked). ``torch.set_num_threads(--threads)``, default 1: on the
2-core machine this was written on, with a C++ build or test run beside it, 2 intra-op threads made most steps wait
for a descheduled thread (a step's mean several times its median, the whole run several times slower, the K-FAC step
hit harder than AdamW's: docs/perf/transformer-vs-adamw-2026-11-26/earlier/); one thread per process degrades
gracefully. ``--threads 2`` is the better setting on an otherwise idle machine.

Timing: host ``time.perf_counter()`` around each whole training step (batch, forward, loss, backward,
optimizer step, scheduler step, zero_grad; with ``--device cuda`` the device is synchronised after the backward
pass and at the step's end, so each time is the device's too); a run's wall time is the sum of its step times, so
evaluation and the other runs' steps are excluded. Time to target: the wall time at the first evaluation whose
validation loss is <= the target (the resolution is one evaluation interval, the same for every optimizer). Target
of a seed: the best validation loss of that seed's tuned AdamW run; AdamW's own time is the time of its best
evaluation. The goal (issue 45): a median ratio of at most GOAL_RATIO (0.75) of AdamW's time.

Writes to ``--out`` (default docs/perf/transformer-vs-adamw-<date>): results.json (everything, including each
run's curve, step-time statistics, dkfac phase times and warnings), curves.csv (one row per evaluation),
runs.csv (one row per run), headline.csv (one row per seed), table.txt (what is printed), curves.svg
(validation loss against training wall time, headline runs) and tuning.svg (phase 1 runs), written by hand (no
plotting library needed), and the same plots as curves.png and tuning.png through gnuplot when it is installed.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import hashlib
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('TRANSFORMERS_VERBOSITY', 'error')

import torch  # noqa: E402

try:
    import dkfac  # noqa: E402
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / 'build' / 'python'))
    import dkfac  # noqa: E402
import dkfac.optim  # noqa: E402
import transformers  # noqa: E402

SKIP_DIRS = {'test', 'tests', 'idle_test', 'site-packages', '__pycache__'}
GOAL_RATIO = 0.75  # issue 45: K-FAC's time to AdamW's best, as a fraction of AdamW's (issue 36 asked for 0.8)


# --- corpus ---------------------------------------------------------------------------------------------------
def load_corpus(max_bytes: int) -> dict:
    root = Path(sysconfig.get_paths()['stdlib'])
    files = sorted(p for p in root.rglob('*.py')
                   if not SKIP_DIRS.intersection(p.relative_to(root).parts[:-1]) and p.is_file())
    train, val = [], []
    total = 0
    used = 0
    digest = hashlib.sha256()
    for index, path in enumerate(files):
        data = path.read_bytes()
        if total + len(data) > max_bytes:
            break
        total += len(data)
        used += 1
        digest.update(str(path.relative_to(root)).encode() + b'\0' + data)
        (val if index % 10 == 9 else train).append(data)
    train_tokens = torch.frombuffer(bytearray(b'\0'.join(train)), dtype=torch.uint8).clone()
    val_tokens = torch.frombuffer(bytearray(b'\0'.join(val)), dtype=torch.uint8).clone()
    return {'root': str(root), 'files_found': len(files), 'files_used': used, 'train_files': len(train),
            'val_files': len(val), 'train_tokens': train_tokens, 'val_tokens': val_tokens, 'bytes': total,
            'sha256': digest.hexdigest()}


def val_windows(tokens: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """``count`` windows of ``length + 1`` tokens at evenly spaced offsets (deterministic)."""
    span = tokens.numel() - (length + 1)
    starts = [round(i * span / max(1, count - 1)) for i in range(count)]
    return torch.stack([tokens[s:s + length + 1] for s in starts]).long()


# --- model ----------------------------------------------------------------------------------------------------
def build_model(args, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=256, n_positions=args.context, n_embd=args.n_embd, n_layer=args.n_layer, n_head=args.n_head,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        tie_word_embeddings=not args.untied)
    model = transformers.GPT2LMHeadModel(config)
    model.train()
    return model


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    plain = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{'params': decay, 'weight_decay': weight_decay}, {'params': plain, 'weight_decay': 0.0}]


def schedule(steps: int, warmup_steps: int):
    warmup = max(1, warmup_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


# --- one training run -----------------------------------------------------------------------------------------
class Run:
    """One optimizer configuration on one seed, stepped one step at a time by the lockstep driver."""

    def __init__(self, args, corpus, val_x, spec: dict, seed: int, phase: str) -> None:
        self.args, self.spec, self.seed, self.phase = args, spec, seed, phase
        self.name = f"{spec['label']}/s{seed}"
        self.steps = spec.get('steps', args.steps)
        self.model = build_model(args, seed).to(args.device)  # initialised on the CPU: the same on every device
        self.tokens = corpus['train_tokens']
        self.val_x = val_x
        self.generator = torch.Generator().manual_seed(1000 + seed)  # the same batches for every run of a seed
        groups = param_groups(self.model, args.weight_decay)
        kind = spec['kind']
        if kind in ('adamw', 'kfac_adamw'):
            base = torch.optim.AdamW(groups, lr=spec['lr'], betas=(0.9, 0.95), eps=1e-8)
        elif kind == 'kfac_sgd':
            base = torch.optim.SGD(groups, lr=spec['lr'], momentum=0.9)
        else:
            raise ValueError(kind)
        self.warnings: list[str] = []
        if kind == 'adamw':
            self.optimizer = base
            self.preconditioner = None
        else:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter('always')
                self.optimizer = dkfac.optim.KFAC(
                    self.model, base, factor_update_steps=spec['factor_steps'], inv_update_steps=spec['inv_steps'],
                    damping=spec['damping'], kl_clip=spec['kl_clip'], graft=spec.get('graft', False),
                    eigen_adam=spec.get('eigen_adam', False), start_preconditioning_step=spec.get('start', 0),
                    **{key: spec[key] for key in ('factor_decay', 'diagonal_factor_dim') if key in spec})
            self.warnings += [str(w.message) for w in caught]
            self.preconditioner = self.optimizer.preconditioner
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(base, schedule(self.steps, args.warmup_steps))
        self.step = 0
        self.train_time = 0.0
        self.step_times: list[float] = []
        self.fb_times: list[float] = []
        self.opt_times: list[float] = []
        self.loss_sum = 0.0
        self.loss_count = 0
        self.curve: list[dict] = []
        self.failed = ''
        self.evaluate()  # step 0

    @property
    def done(self) -> bool:
        return self.step >= self.steps or bool(self.failed)

    def train_step(self) -> None:
        args = self.args
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            t0 = time.perf_counter()
            starts = torch.randint(0, self.tokens.numel() - args.context - 1, (args.batch,),
                                   generator=self.generator)
            batch = torch.stack([self.tokens[s:s + args.context + 1] for s in starts.tolist()]).long()
            batch = batch.to(args.device)
            logits = self.model(input_ids=batch[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            loss.backward()
            synchronize(args.device)
            t1 = time.perf_counter()
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            synchronize(args.device)
            t2 = time.perf_counter()
        for w in caught:
            text = str(w.message)
            if text not in self.warnings:
                self.warnings.append(text)
        value = loss.item()
        self.step += 1
        self.train_time += t2 - t0
        self.step_times.append(t2 - t0)
        self.fb_times.append(t1 - t0)
        self.opt_times.append(t2 - t1)
        if not math.isfinite(value):
            self.failed = f'non-finite training loss at step {self.step}'
        self.loss_sum += value
        self.loss_count += 1
        if self.step % args.eval_every == 0 or self.step == self.steps or self.failed:
            self.evaluate()

    @torch.no_grad()
    def evaluate(self) -> None:
        self.model.eval()
        total, count = 0.0, 0
        for chunk in self.val_x.split(self.args.eval_batch):
            logits = self.model(input_ids=chunk[:, :-1]).logits
            total += torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1), reduction='sum').item()
            count += chunk[:, 1:].numel()
        self.model.train()
        train_loss = self.loss_sum / self.loss_count if self.loss_count else float('nan')
        self.loss_sum, self.loss_count = 0.0, 0
        self.curve.append({'step': self.step, 'train_time_s': self.train_time, 'val_loss': total / count,
                           'train_loss': train_loss, 'lr': self.optimizer.param_groups[0]['lr']})

    # --- results ------------------------------------------------------------------------------------------------
    def best(self) -> dict:
        finite = [c for c in self.curve if math.isfinite(c['val_loss'])]
        return min(finite, key=lambda c: c['val_loss']) if finite else {'val_loss': float('nan'), 'step': None,
                                                                        'train_time_s': None}

    def time_to(self, target: float) -> dict | None:
        for c in self.curve:
            if c['val_loss'] <= target:
                return c
        return None

    def result(self) -> dict:
        warm = self.args.timing_skip
        times = self.step_times[warm:] or self.step_times
        out = {
            'name': self.name, 'phase': self.phase, 'seed': self.seed, 'spec': self.spec, 'steps': self.steps,
            'steps_done': self.step, 'failed': self.failed, 'train_time_s': self.train_time,
            'step_time_s': stats(times), 'forward_backward_s': stats(self.fb_times[warm:] or self.fb_times),
            'optimizer_step_s': stats(self.opt_times[warm:] or self.opt_times),
            'best': self.best(), 'curve': self.curve, 'warnings': self.warnings,
        }
        if self.preconditioner is not None:
            totals = self.preconditioner.phase_times(total=True)
            out['kfac_phase_times_total_s'] = {k: float(v) for k, v in totals.items()}
            out['kfac_layers'] = [name for name, _ in self.preconditioner.layers]
        return out


def synchronize(device: str) -> None:
    """Waits for the device's queued work, so that host timers around a step measure it (nothing on a CPU)."""
    if torch.device(device).type == 'cuda':
        torch.cuda.synchronize(device)


def stats(values: list[float]) -> dict:
    if not values:
        return {}
    ordered = sorted(values)
    return {'n': len(values), 'mean': sum(values) / len(values), 'median': statistics.median(values),
            'p90': ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)],
            'min': ordered[0], 'max': ordered[-1]}


def lockstep(runs: list[Run], log) -> None:
    """Steps every run once in turn (the order rotating), until all are done."""
    rotation = 0
    started = time.perf_counter()
    last_report = started
    while not all(r.done for r in runs):
        order = runs[rotation % len(runs):] + runs[:rotation % len(runs)]
        rotation += 1
        for run in order:
            if not run.done:
                run.train_step()
        now = time.perf_counter()
        if now - last_report > 60:
            last_report = now
            log('  ' + ', '.join(f'{r.name} {r.step}/{r.steps} val {r.curve[-1]["val_loss"]:.3f}' for r in runs)
                + f'  ({now - started:.0f} s)')


# --- configurations -------------------------------------------------------------------------------------------
def tuning_specs(args) -> list[dict]:
    specs = [{'label': f'adamw-lr{lr:g}', 'kind': 'adamw', 'lr': lr} for lr in args.adamw_lrs]
    configs = [(text, False) for text in args.kfac_configs] + [(text, True) for text in args.kfac_graft_configs]
    for text, graft in configs:
        # lr:damping:factor_steps:inv_steps[:steps_fraction[:kl_clip]]
        parts = text.split(':')
        lr, damping = float(parts[0]), float(parts[1])
        factor_steps, inv_steps = int(parts[2]), int(parts[3])
        fraction = float(parts[4]) if len(parts) > 4 else 1.0
        kl_clip = float(parts[5]) if len(parts) > 5 else args.kl_clip
        spec = {'label': f'kfac-{"graft" if graft else "adamw"}-lr{lr:g}-d{damping:g}-f{factor_steps}-i{inv_steps}',
                'kind': 'kfac_adamw', 'lr': lr, 'damping': damping, 'factor_steps': factor_steps,
                'inv_steps': inv_steps, 'kl_clip': kl_clip or None, 'graft': graft}
        if fraction != 1.0:
            spec['label'] += f'-len{fraction:g}'
            spec['steps'] = round(fraction * args.steps)
        if kl_clip != args.kl_clip:
            spec['label'] += f'-kl{kl_clip:g}'
        specs.append(spec)
    for text in args.kfac_eigen_adam_configs:
        # lr:factor_steps:inv_steps[:start_preconditioning_step[:factor_decay[:steps_fraction[:diagonal_factor_dim]]]]
        # (damping and KL clipping do not enter Adam's step in the eigenbasis; an empty field keeps its default)
        parts = text.split(':')
        lr, factor_steps, inv_steps = parts[:3]
        start = int(parts[3]) if len(parts) > 3 and parts[3] else 0
        label = f'kfac-eigenadam-lr{float(lr):g}-f{factor_steps}-i{inv_steps}' + (f'-s{start}' if start else '')
        spec = {'label': label, 'kind': 'kfac_adamw', 'lr': float(lr), 'damping': 0.001,
                'factor_steps': int(factor_steps), 'inv_steps': int(inv_steps), 'kl_clip': None, 'eigen_adam': True,
                'start': start}
        if len(parts) > 4 and parts[4]:
            spec['factor_decay'] = float(parts[4])
            spec['label'] += f'-d{float(parts[4]):g}'
        if len(parts) > 5 and parts[5] and float(parts[5]) != 1.0:  # a schedule of its own, this fraction of AdamW's
            spec['steps'] = round(float(parts[5]) * args.steps)
            spec['label'] += f'-len{float(parts[5]):g}'
        if len(parts) > 6 and parts[6]:  # factors wider than this kept diagonal: a side Adam runs on unrotated
            spec['diagonal_factor_dim'] = int(parts[6])
            spec['label'] += f'-diag{int(parts[6])}'
        specs.append(spec)
    for text in args.kfac_sgd_configs:
        lr, damping, factor_steps, inv_steps = text.split(':')
        specs.append({'label': f'kfac-sgd-lr{float(lr):g}-d{float(damping):g}-f{factor_steps}-i{inv_steps}',
                      'kind': 'kfac_sgd', 'lr': float(lr), 'damping': float(damping),
                      'factor_steps': int(factor_steps), 'inv_steps': int(inv_steps), 'kl_clip': args.kl_clip or None})
    return specs


# --- machine --------------------------------------------------------------------------------------------------
def machine(device: str = 'cpu') -> dict:
    cpu = platform.processor()
    try:
        for line in Path('/proc/cpuinfo').read_text().splitlines():
            if line.startswith('model name'):
                cpu = line.split(':', 1)[1].strip()
                break
    except OSError:
        pass
    if torch.device(device).type == 'cuda':
        device = f'{device} ({torch.cuda.get_device_name(torch.device(device))})'
    info = {'cpu': cpu, 'cores': os.cpu_count(), 'device': device, 'threads': torch.get_num_threads(),
            'python': platform.python_version(), 'torch': torch.__version__, 'transformers': transformers.__version__,
            'dkfac': dkfac.__version__, 'dkfac_path': str(Path(dkfac.__file__).parent)}
    try:
        from dkfac import _build_info
        info['dkfac_build'] = {k: getattr(_build_info, k) for k in ('torch_version', 'compiler', 'build_type')}
    except ImportError:
        pass
    try:
        info['loadavg_start'] = os.getloadavg()
    except OSError:
        pass
    return info


# --- plots (SVG by hand) --------------------------------------------------------------------------------------
COLORS = {'adamw': '#1f77b4', 'kfac_adamw': '#d62728', 'kfac_sgd': '#2ca02c'}
DASHES = ['', '6,3', '2,2', '8,3,2,3', '1,3', '10,4']


def svg_plot(path: Path, series: list[dict], title: str, target: float | None, ymax: float | None) -> None:
    """series: {'label', 'color', 'dash', 'points': [(x, y)]}; validation loss against training wall time."""
    width, height, left, right, top, bottom = 900, 560, 70, 300, 40, 50
    xs = [x for s in series for x, _ in s['points']]
    ys = [y for s in series for _, y in s['points'] if math.isfinite(y)]
    if not xs or not ys:
        return
    x0, x1 = 0.0, max(xs) * 1.02 or 1.0
    y0 = min(ys) - 0.02
    y1 = ymax if ymax is not None else max(ys)
    y1 = max(y1, y0 + 0.1)

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * (width - left - right)

    def py(y: float) -> float:
        return top + (y1 - min(max(y, y0), y1)) / (y1 - y0) * (height - top - bottom)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="12"><rect width="100%" height="100%" fill="white"/>',
           f'<text x="{left}" y="22" font-size="14">{title}</text>']
    for i in range(6):  # grid and ticks
        xv = x0 + (x1 - x0) * i / 5
        yv = y0 + (y1 - y0) * i / 5
        out.append(f'<line x1="{px(xv):.1f}" y1="{top}" x2="{px(xv):.1f}" y2="{height - bottom}" stroke="#ddd"/>')
        out.append(f'<text x="{px(xv):.1f}" y="{height - bottom + 16}" text-anchor="middle">{xv:.0f}</text>')
        out.append(f'<line x1="{left}" y1="{py(yv):.1f}" x2="{width - right}" y2="{py(yv):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{py(yv) + 4:.1f}" text-anchor="end">{yv:.2f}</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{height - top - bottom}" '
               'fill="none" stroke="black"/>')
    out.append(f'<text x="{(left + width - right) / 2}" y="{height - 12}" text-anchor="middle">training wall time '
               '(s, evaluation excluded)</text>')
    out.append(f'<text x="16" y="{(top + height - bottom) / 2}" text-anchor="middle" '
               f'transform="rotate(-90 16 {(top + height - bottom) / 2})">validation loss (nats/byte)</text>')
    if target is not None and y0 <= target <= y1:
        out.append(f'<line x1="{left}" y1="{py(target):.1f}" x2="{width - right}" y2="{py(target):.1f}" '
                   'stroke="black" stroke-dasharray="3,3"/>')
        out.append(f'<text x="{width - right - 4}" y="{py(target) - 4:.1f}" text-anchor="end">target '
                   f'{target:.4f}</text>')
    for index, s in enumerate(series):
        pts = ' '.join(f'{px(x):.1f},{py(y):.1f}' for x, y in s['points'] if math.isfinite(y))
        dash = f' stroke-dasharray="{s["dash"]}"' if s['dash'] else ''
        out.append(f'<polyline points="{pts}" fill="none" stroke="{s["color"]}" stroke-width="1.6"{dash}/>')
        ly = top + 14 + 16 * index
        out.append(f'<line x1="{width - right + 10}" y1="{ly - 4}" x2="{width - right + 40}" y2="{ly - 4}" '
                   f'stroke="{s["color"]}" stroke-width="2"{dash}/>')
        out.append(f'<text x="{width - right + 46}" y="{ly}">{s["label"]}</text>')
    out.append('</svg>')
    path.write_text('\n'.join(out) + '\n')


def plot_runs(path: Path, runs: list[dict], title: str, target: float | None) -> None:
    series = []
    dash_of: dict[str, int] = {}
    for r in runs:
        key = r['spec']['kind']
        dash_of.setdefault(key, 0)
        dash = DASHES[dash_of[key] % len(DASHES)]
        dash_of[key] += 1
        series.append({'label': r['name'], 'color': COLORS.get(key, 'gray'), 'dash': dash,
                       'points': [(c['train_time_s'], c['val_loss']) for c in r['curve']]})
    # the y range: from the best loss to 0.6 nats above the worst final loss (the first steps are off the chart)
    finals = [r['curve'][-1]['val_loss'] for r in runs if math.isfinite(r['curve'][-1]['val_loss'])]
    ymax = (max(finals) + 0.6) if finals else None
    svg_plot(path, series, title, target, ymax)
    gnuplot_png(path.with_suffix('.png'), series, title, target, ymax)


def gnuplot_png(path: Path, series: list[dict], title: str, target: float | None, ymax: float | None) -> bool:
    """The same plot as a PNG through gnuplot (pngcairo), when gnuplot is installed; False otherwise."""
    gnuplot = shutil.which('gnuplot')
    if not gnuplot or not series:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / 'curves.dat'
        with open(data, 'w') as f:
            for s in series:
                f.write(''.join(f'{x:.4f} {y:.5f}\n' for x, y in s['points'] if math.isfinite(y)) + '\n\n')
        plots = []
        for index, s in enumerate(series):
            dash = {'': 1, '6,3': 2, '2,2': 3, '8,3,2,3': 4, '1,3': 5, '10,4': 2}.get(s['dash'], 1)
            plots.append(f"'{data}' index {index} using 1:2 with lines lw 1.5 lc rgb '{s['color']}' dt {dash} "
                         f"title '{s['label']}'")
        if target is not None:
            plots.append(f"{target} with lines lc rgb 'black' dt 3 title 'target {target:.4f}'")
        ys = [y for s in series for _, y in s['points'] if math.isfinite(y)]
        script = '\n'.join([
            'set terminal pngcairo size 1100,600 font "sans,10"', f"set output '{path}'",
            f"set title '{title}' noenhanced", "set xlabel 'training wall time (s, evaluation excluded)'",
            "set ylabel 'validation loss (nats/byte)'", 'set grid', 'set key outside right noenhanced',
            f'set yrange [{min(ys) - 0.02}:{ymax if ymax is not None else max(ys)}]', 'set xrange [0:*]',
            'plot ' + ', \\\n  '.join(plots), ''])
        (Path(tmp) / 'plot.gp').write_text(script)
        try:
            done = subprocess.run([gnuplot, str(Path(tmp) / 'plot.gp')], capture_output=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return done.returncode == 0 and path.exists()


# --- main -----------------------------------------------------------------------------------------------------
def main() -> int:
    today = datetime.date.today().isoformat()
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--quick', action='store_true', help='smoke check: tiny budget (under 3 minutes)')
    parser.add_argument('--out', default=None, help=f'output directory (default docs/perf/transformer-vs-adamw-{today}'
                        ', or /tmp/transformer-vs-adamw-quick with --quick)')
    parser.add_argument('--threads', type=int, default=1,
                        help='torch.set_num_threads (default 1: see the module docstring)')
    parser.add_argument('--device', default='cpu',
                        help='where the models train (cpu, or cuda: each step timed to the device\'s end of it)')
    parser.add_argument('--steps', type=int, default=None, help='training steps of a full-length schedule')
    parser.add_argument('--batch', type=int, default=16)
    parser.add_argument('--context', type=int, default=128)
    parser.add_argument('--n-embd', type=int, default=64)
    parser.add_argument('--n-layer', type=int, default=3)
    parser.add_argument('--n-head', type=int, default=4)
    parser.add_argument('--untied', action='store_true', help='untie the input embedding and the LM head')
    parser.add_argument('--weight-decay', type=float, default=0.1)
    parser.add_argument('--warmup-steps', type=int, default=None,
                        help='linear warm-up steps, the same for every run whatever its length (default 60)')
    parser.add_argument('--eval-every', type=int, default=None)
    parser.add_argument('--val-windows', type=int, default=None)
    parser.add_argument('--eval-batch', type=int, default=64)
    parser.add_argument('--max-bytes', type=int, default=16 << 20)
    parser.add_argument('--timing-skip', type=int, default=5, help='first steps left out of step-time statistics')
    parser.add_argument('--adamw-lrs', type=float, nargs='+', default=None)
    parser.add_argument('--kfac-configs', nargs='*', default=None,
                        help='K-FAC + AdamW candidates, each lr:damping:factor_steps:inv_steps[:steps_fraction'
                        '[:kl_clip]]')
    parser.add_argument('--kfac-sgd-configs', nargs='*', default=None, help='K-FAC + SGD candidates, lr:damping:f:i')
    parser.add_argument('--kfac-graft-configs', nargs='*', default=[],
                        help='K-FAC + AdamW candidates with grafting (dkfac.optim.KFAC(graft=True): K-FAC\'s '
                             'direction, AdamW\'s step length per layer), in --kfac-configs\' format')
    parser.add_argument('--kfac-eigen-adam-configs', nargs='*', default=[],
                        help='Adam in the K-FAC eigenbasis (dkfac.optim.KFAC(eigen_adam=True), AdamW\'s betas and '
                             'eps) candidates, lr:factor_steps:inv_steps[:start_preconditioning_step[:factor_decay'
                             '[:steps_fraction[:diagonal_factor_dim]]]] (factor_decay: the running factors\' decay, '
                             'default the preconditioner\'s 0.95; steps_fraction: a schedule of its own, that '
                             'fraction of --steps long; diagonal_factor_dim: factors wider than this are kept '
                             'diagonal, so Adam runs unrotated on that side; an empty field keeps its default)')
    parser.add_argument('--kl-clip', type=float, default=0.001)
    parser.add_argument('--seeds', type=int, default=None, help='headline seeds besides the tuning seed 0')
    parser.add_argument('--headline-from', default='kfac-',
                        help='the headline K-FAC run is chosen among the tuning runs whose label starts with this '
                             '(e.g. kfac-eigenadam); the others are tuning figures only')
    args = parser.parse_args()

    if args.quick:
        defaults = dict(steps=120, warmup_steps=10, eval_every=30, val_windows=64, adamw_lrs=[3e-3], seeds=1,
                        kfac_configs=['3e-3:0.01:10:50'], kfac_sgd_configs=[])
    else:
        defaults = dict(steps=1200, warmup_steps=60, eval_every=50, val_windows=128, seeds=3,
                        adamw_lrs=[4e-3, 8e-3, 1.6e-2],
                        kfac_configs=['8e-3:0.01:10:100', '8e-3:0.01:10:100:0.75', '8e-3:0.01:10:100:0.6',
                                      '1.6e-2:0.01:10:100:0.75'],
                        kfac_sgd_configs=[])
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    repository = Path(__file__).resolve().parent.parent
    out = Path(args.out or ('/tmp/transformer-vs-adamw-quick' if args.quick
                            else repository / 'docs' / 'perf' / f'transformer-vs-adamw-{today}'))
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    lines: list[str] = []

    def log(text: str = '') -> None:
        print(text, flush=True)
        lines.append(text)

    info = machine(args.device)
    corpus = load_corpus(args.max_bytes)
    val_x = val_windows(corpus['val_tokens'], args.val_windows, args.context).to(args.device)
    n_params = sum(p.numel() for p in build_model(args, 0).parameters())
    log(f"machine: {info['cpu']}, {info['cores']} cores; device {info['device']}; torch threads {info['threads']}; "
        f"python {info['python']}; torch {info['torch']}; transformers {info['transformers']}; "
        f"dkfac {info['dkfac']} ({info['dkfac_path']})")
    log(f"corpus: {corpus['files_used']} of {corpus['files_found']} stdlib .py files under {corpus['root']} "
        f"({corpus['bytes']} bytes, sha256 {corpus['sha256'][:12]}); train {corpus['train_files']} files "
        f"{corpus['train_tokens'].numel()} tokens, validation {corpus['val_files']} files "
        f"{corpus['val_tokens'].numel()} tokens, subset {args.val_windows} x {args.context} tokens")
    log(f"model: GPT-2 n_embd {args.n_embd}, n_layer {args.n_layer}, n_head {args.n_head}, context {args.context}, "
        f"vocab 256, {'untied' if args.untied else 'tied'} embeddings, {n_params} parameters; batch {args.batch} x "
        f"{args.context} tokens; {args.steps} steps; warm-up {args.warmup_steps} steps then cosine to 0.1x; eval every "
        f"{args.eval_every} steps")
    started = time.perf_counter()

    # phase 1: tuning on seed 0
    specs = tuning_specs(args)
    log(f'\nphase 1 (seed 0, lockstep): {len(specs)} runs: ' + ', '.join(s['label'] for s in specs))
    runs = [Run(args, corpus, val_x, spec, 0, 'tuning') for spec in specs]
    lockstep(runs, log)
    tuning = [r.result() for r in runs]
    del runs
    adamw_runs = [r for r in tuning if r['spec']['kind'] == 'adamw']
    best_adamw = min(adamw_runs, key=lambda r: r['best']['val_loss'])
    target0 = best_adamw['best']['val_loss']
    for r in tuning:
        hit = next((c for c in r['curve'] if c['val_loss'] <= target0), None)
        r['to_target_seed0'] = hit
    kfac_runs = [r for r in tuning if r['spec']['kind'] == 'kfac_adamw'
                 and r['spec']['label'].startswith(args.headline_from)]
    reached = [r for r in kfac_runs if r['to_target_seed0']]
    best_kfac = (min(reached, key=lambda r: r['to_target_seed0']['train_time_s']) if reached
                 else min(kfac_runs, key=lambda r: r['best']['val_loss']))

    log(f'\nphase 1 results (seed 0); target = best validation loss of the best AdamW lr = {target0:.4f}')
    header = (f"{'run':44} {'best val':>8} {'at step':>7} {'train s':>8} {'to target':>10} {'steps':>6} "
              f"{'step ms med':>11} {'p90':>6}")
    log(header)
    for r in tuning:
        hit = r['to_target_seed0']
        log(f"{r['name']:44} {r['best']['val_loss']:8.4f} {r['best']['step']:7d} {r['train_time_s']:8.1f} "
            f"{(format(hit['train_time_s'], '.1f') + ' s') if hit else 'not reached':>10} "
            f"{hit['step'] if hit else '':>6} {r['step_time_s']['median'] * 1e3:11.1f} "
            f"{r['step_time_s']['p90'] * 1e3:6.1f}" + (f"  FAILED: {r['failed']}" if r['failed'] else ''))
    log(f"chosen: {best_adamw['spec']['label']} (lowest best validation loss) and {best_kfac['spec']['label']} "
        f"({'soonest to the target' if reached else 'no K-FAC run reached the target: lowest best validation loss'})")

    # phase 2: headline seeds
    seeds = list(range(1, args.seeds + 1))
    headline = [best_adamw, best_kfac]
    for seed in seeds:
        pair = [best_adamw['spec'], best_kfac['spec']]
        if seed % 2 == 1:
            pair.reverse()  # which run steps first within a lockstep iteration alternates as well (it rotates anyway)
        log(f'\nphase 2, seed {seed} (lockstep): ' + ', '.join(s['label'] for s in pair))
        runs = [Run(args, corpus, val_x, spec, seed, 'headline') for spec in pair]
        lockstep(runs, log)
        results = [r.result() for r in runs]
        headline += sorted(results, key=lambda r: r['spec']['kind'] != 'adamw')
        del runs

    rows = []
    for seed in [0] + seeds:
        a = next(r for r in headline if r['seed'] == seed and r['spec']['kind'] == 'adamw')
        k = next(r for r in headline if r['seed'] == seed and r['spec']['kind'] == 'kfac_adamw')
        target = a['best']['val_loss']
        hit = next((c for c in k['curve'] if c['val_loss'] <= target), None)
        rows.append({
            'seed': seed, 'from_tuning': seed == 0, 'target_val_loss': target,
            'adamw_time_s': a['best']['train_time_s'], 'adamw_steps': a['best']['step'],
            'kfac_time_s': hit['train_time_s'] if hit else None, 'kfac_steps': hit['step'] if hit else None,
            'ratio': (hit['train_time_s'] / a['best']['train_time_s']) if hit else None,
            'kfac_best_val_loss': k['best']['val_loss'],
            'adamw_step_ms_median': a['step_time_s']['median'] * 1e3,
            'adamw_step_ms_p90': a['step_time_s']['p90'] * 1e3,
            'adamw_step_ms_mean': a['step_time_s']['mean'] * 1e3,
            'kfac_step_ms_median': k['step_time_s']['median'] * 1e3, 'kfac_step_ms_p90': k['step_time_s']['p90'] * 1e3,
            'kfac_step_ms_mean': k['step_time_s']['mean'] * 1e3,
            'step_cost_ratio_mean': k['step_time_s']['mean'] / a['step_time_s']['mean'],
        })
    log(f"\nheadline: {best_adamw['spec']['label']} against {best_kfac['spec']['label']}; target of a seed = its "
        'AdamW best validation loss; times are training wall time (evaluation excluded)')
    log(f"{'seed':>4} {'target':>7} {'AdamW s':>8} {'steps':>6} {'K-FAC s':>8} {'steps':>6} {'ratio':>6} "
        f"{'K-FAC best':>10} {'AdamW step ms med/p90/mean':>27} {'K-FAC step ms med/p90/mean':>27} {'cost x':>6}")
    for row in rows:
        log(f"{row['seed']:>3}{'*' if row['from_tuning'] else ' '} {row['target_val_loss']:7.4f} "
            f"{row['adamw_time_s']:8.1f} {row['adamw_steps']:6d} "
            f"{format(row['kfac_time_s'], '8.1f') if row['kfac_time_s'] is not None else '       -'} "
            f"{row['kfac_steps'] if row['kfac_steps'] is not None else '-':>6} "
            f"{format(row['ratio'], '6.2f') if row['ratio'] is not None else '     -'} "
            f"{row['kfac_best_val_loss']:10.4f} "
            f"{row['adamw_step_ms_median']:9.1f}/{row['adamw_step_ms_p90']:6.1f}/{row['adamw_step_ms_mean']:6.1f}     "
            f"{row['kfac_step_ms_median']:9.1f}/{row['kfac_step_ms_p90']:6.1f}/{row['kfac_step_ms_mean']:6.1f}     "
            f"{row['step_cost_ratio_mean']:6.2f}")
    log('(* seed 0 is the tuning seed; cost x = K-FAC mean step time / AdamW mean step time)')

    def median_of(key: str):
        values = [r[key] for r in rows if r[key] is not None]
        return statistics.median(values) if len(values) == len(rows) else None

    summary = {
        'seeds': len(rows), 'kfac_reached_target_in': sum(r['kfac_time_s'] is not None for r in rows),
        'adamw_time_s_median': median_of('adamw_time_s'), 'kfac_time_s_median': median_of('kfac_time_s'),
        'ratio_median': median_of('ratio'), 'adamw_steps_median': median_of('adamw_steps'),
        'kfac_steps_median': median_of('kfac_steps'),
        'step_cost_ratio_median': median_of('step_cost_ratio_mean'),
        'adamw_step_ms_median_of_medians': median_of('adamw_step_ms_median'),
        'kfac_step_ms_median_of_medians': median_of('kfac_step_ms_median'),
        'goal_ratio': GOAL_RATIO,
    }
    if summary['ratio_median'] is not None and summary['kfac_steps_median'] and summary['adamw_steps_median']:
        summary['steps_ratio_median'] = statistics.median(r['kfac_steps'] / r['adamw_steps'] for r in rows)
    ratio = summary['ratio_median']
    summary['goal_met'] = ratio is not None and ratio <= GOAL_RATIO
    fresh = [r['ratio'] for r in rows if not r['from_tuning']]
    summary['ratio_median_fresh_seeds'] = (statistics.median(fresh) if fresh and None not in fresh else None)
    summary['ratios'] = [r['ratio'] for r in rows]
    log(f"\nmedian over {len(rows)} seeds: AdamW {summary['adamw_time_s_median']:.1f} s "
        f"({summary['adamw_steps_median']:g} steps) to its best; {best_kfac['spec']['label']} "
        + (f"{summary['kfac_time_s_median']:.1f} s ({summary['kfac_steps_median']:g} steps) to the same loss: "
           f"ratio {ratio:.2f} (goal <= {GOAL_RATIO}: {'met' if summary['goal_met'] else 'missed'})"
           if ratio is not None else
           f"reached the target on {summary['kfac_reached_target_in']} of {len(rows)} seeds: goal missed")
        + f"; K-FAC step cost {summary['step_cost_ratio_median']:.2f}x AdamW's (mean step time, median over seeds)")
    if summary['ratio_median_fresh_seeds'] is not None:
        untuned = ', '.join(str(r['seed']) for r in rows if not r['from_tuning'])
        log(f"median ratio over the seeds not used for tuning ({untuned}): {summary['ratio_median_fresh_seeds']:.2f}")
    elapsed = time.perf_counter() - started
    log(f'total elapsed {elapsed:.0f} s (training, evaluation and setup)')

    # phase times of the chosen K-FAC (seed 0)
    for r in [best_kfac]:
        if 'kfac_phase_times_total_s' in r:
            pt = r['kfac_phase_times_total_s']
            log(f"dkfac phase times of {r['name']} (total over {r['steps_done']} steps, s): "
                + ', '.join(f'{k} {v:.2f}' for k, v in pt.items())
                + f"; forward+backward mean {r['forward_backward_s']['mean'] * 1e3:.1f} ms/step against AdamW's "
                f"{best_adamw['forward_backward_s']['mean'] * 1e3:.1f} ms; optimizer step mean "
                f"{r['optimizer_step_s']['mean'] * 1e3:.1f} ms against "
                f"{best_adamw['optimizer_step_s']['mean'] * 1e3:.1f} ms")
    seen = []
    for r in tuning + headline:
        for w in r['warnings']:
            if w not in seen:
                seen.append(w)
    if seen:
        log('warnings (each once):')
        for w in seen:
            log('  ' + w)

    # outputs
    try:
        info['loadavg_end'] = os.getloadavg()
    except OSError:
        pass
    config = {k: v for k, v in vars(args).items()}
    corpus_info = {k: v for k, v in corpus.items() if not isinstance(v, torch.Tensor)}
    corpus_info['train_tokens'] = corpus['train_tokens'].numel()
    corpus_info['val_tokens'] = corpus['val_tokens'].numel()
    all_runs = tuning + [r for r in headline if r['phase'] == 'headline']
    (out / 'results.json').write_text(json.dumps({
        'date': today, 'machine': info, 'config': config, 'corpus': corpus_info, 'parameters': n_params,
        'elapsed_s': elapsed, 'target_seed0': target0, 'chosen_adamw': best_adamw['spec'],
        'chosen_kfac': best_kfac['spec'], 'headline': rows, 'summary': summary, 'runs': all_runs}, indent=1) + '\n')
    with open(out / 'curves.csv', 'w', newline='') as f:
        w = csv.writer(f)
        w.writerow(['run', 'phase', 'kind', 'seed', 'step', 'train_time_s', 'val_loss', 'train_loss', 'lr'])
        for r in all_runs:
            for c in r['curve']:
                w.writerow([r['name'], r['phase'], r['spec']['kind'], r['seed'], c['step'], f"{c['train_time_s']:.4f}",
                            f"{c['val_loss']:.5f}", f"{c['train_loss']:.5f}", f"{c['lr']:.6g}"])
    with open(out / 'runs.csv', 'w', newline='') as f:
        w = csv.writer(f)
        w.writerow(['run', 'phase', 'kind', 'seed', 'steps', 'train_time_s', 'best_val_loss', 'best_step',
                    'step_ms_median', 'step_ms_p90', 'step_ms_mean', 'fb_ms_mean', 'opt_ms_mean', 'failed'])
        for r in all_runs:
            w.writerow([r['name'], r['phase'], r['spec']['kind'], r['seed'], r['steps_done'],
                        f"{r['train_time_s']:.3f}",
                        f"{r['best']['val_loss']:.5f}", r['best']['step'], f"{r['step_time_s']['median'] * 1e3:.2f}",
                        f"{r['step_time_s']['p90'] * 1e3:.2f}", f"{r['step_time_s']['mean'] * 1e3:.2f}",
                        f"{r['forward_backward_s']['mean'] * 1e3:.2f}", f"{r['optimizer_step_s']['mean'] * 1e3:.2f}",
                        r['failed']])
    with open(out / 'headline.csv', 'w', newline='') as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    plot_runs(out / 'curves.svg', headline, f"GPT-2 ({n_params} params) on stdlib sources: "
              f"{best_adamw['spec']['label']} vs {best_kfac['spec']['label']}", None)
    plot_runs(out / 'tuning.svg', tuning, 'phase 1 (seed 0): every candidate; dotted line: target', target0)
    (out / 'table.txt').write_text('\n'.join(lines) + '\n')
    print(f"\nwrote {out}/: {' '.join(sorted(f.name for f in out.iterdir() if f.is_file()))}")
    return 0


if __name__ == '__main__':
    sys.exit(main())
