#!/usr/bin/env python3
"""Python training-step benchmark: plain SGD vs dkfac vs kfac_pytorch, same models, data and threads.

One process, no torch.distributed. For each model and each (factor, inverse) interval, it builds a fresh
model (same seed) per method, each with its own SGD optimizer and, for dkfac and kfac_pytorch, a
KFACPreconditioner with the same settings (eigen, damping, lr, kl_clip, factor_decay, float32 inverses),
then times the whole training step ``zero_grad; forward; loss; backward; [preconditioner.step()];
optimizer.step()`` on the same sequence of batches.

Models:

* "cnn": the C++ tools' cnn, and "resnet": the adapted ResNet of examples/fmnist_models.py, on batch-128
  Fashion-MNIST batches, lr 0.1 (the CPU defaults);
* "resnet50": torchvision's ResNet-50 (1000 classes, ImageNet's head) at batch 64 on synthetic N(0,1)
  3x224x224 images with uniform random labels, lr 0.025 (0.1 per 256 images);
* "bert": a BERT-Large-shaped encoder stack (hidden 1024, 16 heads, FFN 4096, sequence 128, 24 layers,
  post-LayerNorm, GELU, no dropout) whose attention projections (query, key, value, output) and two FFN
  layers are explicit ``torch.nn.Linear`` modules, so that dkfac and kfac_pytorch precondition the same
  layers (``torch.nn.MultiheadAttention``'s in-projection is no Linear, and kfac_pytorch v0.4.2 does not
  register its out_proj); token and position embeddings and LayerNorms are not preconditioned. Batch 32 of
  synthetic uniform random tokens (vocabulary 30522) with a per-token 2-class target through a Linear head
  (also preconditioned: 24 x 6 + 1 = 145 layers), lr 0.01.

The default models are cnn,resnet on the CPU and resnet50,bert on CUDA; ``--quick`` makes resnet50 and
bert tiny (a one-block-per-stage Bottleneck ResNet on 32x32 images; 2 layers of hidden 64; batch 4) so that
their code paths run on a CPU in seconds. Each shape has its flag (``--bert-layers`` etc.), which wins.

Schedules:

* interleaved (the CPU default): after a few warm-up steps, windows of N whole inverse periods (so every
  window holds the same number of inverse and factor steps), several repeats; the methods' windows are
  interleaved (plain, dkfac, kfac_pytorch, the order rotating per repeat) so that a change in machine load
  hits all of them;
* sequential (the CUDA default): each method runs alone (model built, warmed up, its windows, freed), so
  that its peak GPU memory (``torch.cuda.max_memory_allocated``, reset before each) is its own; plain SGD
  runs once per model and serves both intervals. ``--budget-s`` stops adding windows to a configuration
  once the next one would pass that many seconds of its windows (the first window always runs). A
  configuration that fails (e.g. out of memory) is reported as failed and the others still run.

CUDA defaults: windows of at least 10 steps (one inverse period at (1,10), 100 steps at (10,100)), up to 5
per configuration within 20 s, plain SGD 20 steps per window, 3 warm-up steps (the first is an inverse step).

Timing: on the CPU, host time around each step. On CUDA, ``torch.cuda.synchronize()`` around each window
(its time / its steps is the amortised step time) and CUDA events recorded on the current stream between
the step's parts (per-step times and splits, read after the window); host time is never taken around
kernels that are still running. Reported:

* step time = window time / window steps (amortised over the inverse periods): median and p90 over the
  windows, and the per-step mean, median and p90 over all measured steps (inverse steps included in
  proportion, since windows hold whole inverse periods);
* the K-FAC overhead = K-FAC step - plain step (amortised medians), and dkfac's overhead / kfac_pytorch's;
* per-step splits for every method (forward+backward, preconditioner.step(), optimizer), and dkfac's
  per-phase times from ``phase_times()`` (CPU: mean per step, median, p90; CUDA: the mean per step from
  ``phase_times(total=True)`` around each window, since reading each step's would synchronise every step);
* sequential schedule: each method's peak GPU memory (CUDA), the K-FAC memory (peak - plain SGD's peak),
  each preconditioner's ``memory_usage()['total']``, how many layers each registered (of the model's
  Linear and Conv2d), and a verdict line per configuration on the goal (dkfac's overhead at most 0.5x
  kfac_pytorch's, dkfac's K-FAC memory no larger).

``--json`` is rewritten after every configuration (with ``"partial": true`` until the run ends), so a run
that is stopped keeps what it measured; ``--markdown`` writes the table docs/PERFORMANCE.md takes.

    python bench/python_step.py --kfac-pytorch-src /path/to/kfac_pytorch   # full, ~8 min on 2 cores
    python bench/python_step.py --quick                                  # ~40 s (~80 s with kfac_pytorch)
    python bench/python_step.py --quick --configure-allocator            # dkfac.configure_allocator() first
    python bench/python_step.py --models cnn --intervals 1,10 --json out.json
    python bench/python_step.py --device cuda --kfac-pytorch-src .gpu-bundle/kfac-pytorch --json gpu.json \\
        --markdown gpu.md                                                  # resnet50 and bert on a GPU
    python bench/python_step.py --models resnet50,bert --quick --intervals 1,2   # their code paths on a CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / 'examples'))
import fmnist_models  # noqa: E402

METHODS = ('sgd', 'dkfac', 'kfac_pytorch')
DKFAC_PHASES = ('factors', 'second_order', 'precondition', 'apply', 'communication')
SPLITS = ('forward_backward', 'kfac_step', 'optimizer')
FMNIST_MODELS = ('cnn', 'resnet')
SYNTHETIC_MODELS = ('resnet50', 'bert')

# Per-device defaults of the options left unset: (repeats, min window steps, plain steps, warm-up, budget s).
DEFAULTS = {'cpu': (3, 30, 30, 3, 0.0), 'cuda': (5, 10, 20, 3, 20.0)}
# Shapes of the synthetic models, full and --quick (an explicit flag wins over both).
SHAPES = {
    False: dict(image_size=224, classes=1000, bert_layers=24, bert_hidden=1024, bert_heads=16, bert_ffn=4096,
                seq_len=128, vocab=30522),
    True: dict(image_size=32, classes=10, bert_layers=2, bert_hidden=64, bert_heads=4, bert_ffn=256, seq_len=16,
               vocab=1000),
}
BATCH = {'cnn': 128, 'resnet': 128, 'resnet50': 64, 'bert': 32}
# SGD's lr (also K-FAC's for KL clipping) per model: ResNet-50 by the linear scaling rule (0.1 per 256 images);
# plain SGD at 0.1 diverges on the synthetic data of resnet50 and bert.
LR = {'cnn': 0.1, 'resnet': 0.1, 'resnet50': 0.025, 'bert': 0.01}
QUICK_BATCH = {'resnet50': 4, 'bert': 4}


def option_value(key: str, text: str) -> Any:
    """A --variant value as the preconditioner takes it: a torch dtype for *_dtype, true/false as a bool, a number
    as a number (eigen_adam=true,kl_clip=0), anything else as the text (precondition_dtype=tf32)."""
    if key.endswith('_dtype') and isinstance(getattr(torch, text, None), torch.dtype):
        return getattr(torch, text)
    if text.lower() in ('true', 'false'):
        return text.lower() == 'true'
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_variants(specs: list[str], error: Callable[[str], Any]) -> dict[str, dict[str, Any]]:
    """--variant NAME:KEY=VALUE[,KEY=VALUE] values as {NAME: options}: dkfac with those options, as method NAME."""
    variants: dict[str, dict[str, Any]] = {}
    for spec in specs:
        name, _, settings = spec.partition(':')
        options: dict[str, Any] = {}
        for item in filter(None, settings.split(',')):
            key, _, value = item.partition('=')
            if not key or not value:
                error(f'--variant {spec!r}: expected NAME:KEY=VALUE[,KEY=VALUE]')
            options[key] = option_value(key, value)
        if not name or not options or name in METHODS:
            error(f'--variant {spec!r}: a new method name and at least one option')
        variants[name] = options
    return variants


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--device', choices=['cpu', 'cuda'], default='cpu',
                        help='where models, data and K-FAC state live (cuda: the current CUDA device)')
    parser.add_argument('--models', default=None,
                        help='comma-separated: cnn, resnet, resnet50, bert (default: cnn,resnet on the CPU, '
                             'resnet50,bert on CUDA)')
    parser.add_argument('--depth', type=int, default=14, help='ResNet depth (6n + 2)')
    parser.add_argument('--width', type=int, default=16, help='ResNet first-stage width')
    parser.add_argument('--intervals', default='1,10;10,100',
                        help="'factor,inverse' pairs separated by ';' (inverse a multiple of factor)")
    parser.add_argument('--batch-size', type=int, default=None,
                        help='batch size (default per model: cnn and resnet 128, resnet50 64, bert 32)')
    parser.add_argument('--threads', type=int, default=os.cpu_count() or 1, help='torch.set_num_threads')
    parser.add_argument('--configure-allocator', action='store_true',
                        help='call dkfac.configure_allocator() first (as the dkfac command line does)')
    parser.add_argument('--schedule', choices=['interleaved', 'sequential'], default=None,
                        help='interleave the methods\' windows (CPU default) or run each method alone '
                             '(CUDA default; measures peak GPU memory per method)')
    parser.add_argument('--repeats', type=int, default=None,
                        help='measured windows per method and interval (default 3 on the CPU, 5 on CUDA)')
    parser.add_argument('--min-window-steps', type=int, default=None,
                        help='a window is the fewest whole inverse periods with at least this many steps '
                             '(default 30 on the CPU, 10 on CUDA)')
    parser.add_argument('--plain-steps', type=int, default=None,
                        help='steps per plain-SGD window (its steps are all alike; default 30 CPU, 20 CUDA)')
    parser.add_argument('--warmup', type=int, default=None, help='steps before the first window, per method')
    parser.add_argument('--budget-s', type=float, default=None,
                        help='sequential schedule: no further window of a configuration once the next would '
                             'pass this many seconds of its windows (default: none on the CPU, 20 on CUDA)')
    parser.add_argument('--damping', type=float, default=0.003)
    parser.add_argument('--lr', type=float, default=None,
                        help='SGD lr, also the lr K-FAC uses for KL clipping (default per model: cnn and resnet '
                             '0.1, resnet50 0.025, bert 0.01)')
    parser.add_argument('--kl-clip', type=float, default=0.001)
    parser.add_argument('--keep-gradients', action='store_true',
                        help='every method zeroes its gradients in place (zero_grad(set_to_none=False)), so that they '
                             'keep their memory from step to step, as a cuda_graphs variant needs to replay its graph '
                             '(default: set to None, zero_grad\'s default)')
    parser.add_argument('--factor-decay', type=float, default=0.95)
    parser.add_argument('--data', choices=['real', 'random'], default='real',
                        help='cnn and resnet: Fashion-MNIST batches (random when its files are absent) or random ones')
    parser.add_argument('--data-dir',
                        default=os.environ.get('DKFAC_FASHION_MNIST', '/usr/share/datasets/fashion-mnist'),
                        help='Fashion-MNIST directory (default $DKFAC_FASHION_MNIST or Debian\'s)')
    parser.add_argument('--batches', type=int, default=None,
                        help='distinct batches, cycled (default 16 of Fashion-MNIST, 4 synthetic ones)')
    parser.add_argument('--image-size', type=int, default=None, help='resnet50: image side (default 224)')
    parser.add_argument('--classes', type=int, default=None, help='resnet50: classes (default 1000)')
    parser.add_argument('--bert-layers', type=int, default=None, help='bert: encoder layers (default 24)')
    parser.add_argument('--bert-hidden', type=int, default=None, help='bert: hidden size (default 1024)')
    parser.add_argument('--bert-heads', type=int, default=None, help='bert: attention heads (default 16)')
    parser.add_argument('--bert-ffn', type=int, default=None, help='bert: FFN inner size (default 4096)')
    parser.add_argument('--seq-len', type=int, default=None, help='bert: sequence length (default 128)')
    parser.add_argument('--vocab', type=int, default=None, help='bert: vocabulary size (default 30522)')
    parser.add_argument('--bert-classes', type=int, default=2, help='bert: classes of the per-token target')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--kfac-pytorch-src', default=None,
                        help="directory holding kfac_pytorch's 'kfac' package; without it kfac_pytorch is not run")
    parser.add_argument('--no-dkfac', action='store_true', help='leave dkfac out')
    parser.add_argument('--quick', action='store_true',
                        help='one repeat of one inverse period, 10 plain steps, 2 warm-up steps (~1 min); '
                             'tiny resnet50 and bert')
    parser.add_argument('--variant', action='append', default=[], metavar='NAME:KEY=VALUE[,KEY=VALUE]',
                        help='also run dkfac with these options, as method NAME, interleaved with the others (e.g. '
                             'shared:shared_input_layers=(query|key|value)$); repeatable')
    parser.add_argument('--json', default=None, help='also write the results to this JSON file')
    parser.add_argument('--markdown', default=None, help='also write a markdown table to this file')
    args = parser.parse_args(argv)
    args.variants = parse_variants(args.variant, parser.error)
    if args.device == 'cuda' and not torch.cuda.is_available():
        parser.error('--device cuda: torch.cuda.is_available() is False')
    if args.models is None:
        args.models = 'cnn,resnet' if args.device == 'cpu' else 'resnet50,bert'
    args.models = [m.strip() for m in args.models.split(',') if m.strip()]
    for m in args.models:
        if m not in FMNIST_MODELS + SYNTHETIC_MODELS:
            parser.error(f'unknown model {m!r}: choose from {", ".join(FMNIST_MODELS + SYNTHETIC_MODELS)}')
    repeats, window, plain, warmup, budget = DEFAULTS[args.device]
    args.repeats = repeats if args.repeats is None else args.repeats
    args.min_window_steps = window if args.min_window_steps is None else args.min_window_steps
    args.plain_steps = plain if args.plain_steps is None else args.plain_steps
    args.warmup = warmup if args.warmup is None else args.warmup
    args.budget_s = budget if args.budget_s is None else args.budget_s
    if args.quick:
        args.repeats, args.min_window_steps, args.plain_steps, args.warmup = 1, 1, 10, 2
    for name, value in SHAPES[args.quick].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.bert_hidden % args.bert_heads:
        parser.error(f'--bert-hidden {args.bert_hidden} must be a multiple of --bert-heads {args.bert_heads}')
    if args.schedule is None:
        args.schedule = 'interleaved' if args.device == 'cpu' else 'sequential'
    if args.variants and args.schedule != 'interleaved':
        parser.error('--variant runs with the interleaved schedule (bench/step_kinds.py takes it on CUDA)')
    intervals = []
    for pair in args.intervals.split(';'):
        f, i = (int(v) for v in pair.split(','))
        if f <= 0 or i <= 0 or i % f:
            parser.error(f'interval {pair}: inverse steps must be a positive multiple of the factor steps')
        intervals.append((f, i))
    args.intervals = intervals
    return args


def lr_for(args: argparse.Namespace, model_name: str) -> float:
    return LR[model_name] if args.lr is None else args.lr


def lr_text(args: argparse.Namespace) -> str:
    lrs = {m: lr_for(args, m) for m in args.models}
    if len(set(lrs.values())) == 1:
        return f'{next(iter(lrs.values()))}'
    return ', '.join(f'{lr} ({m})' for m, lr in lrs.items())


def batch_size(args: argparse.Namespace, model_name: str) -> int:
    if args.batch_size is not None:
        return args.batch_size
    return QUICK_BATCH.get(model_name, BATCH[model_name]) if args.quick else BATCH[model_name]


# --- environment ----------------------------------------------------------------------------------------
def cpu_model() -> str:
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.startswith('model name'):
                    return line.split(':', 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or 'unknown'


def load_average() -> str:
    try:
        return ' '.join(f'{v:.2f}' for v in os.getloadavg())
    except OSError:
        return 'unknown'


def nvidia_driver() -> str | None:
    try:
        out = subprocess.run(['nvidia-smi', '--query-gpu=driver_version', '--format=csv,noheader'],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return out.strip().splitlines()[0] if out.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def cuda_environment() -> dict[str, Any]:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        'device': props.name, 'device_memory_gib': round(props.total_memory / 2**30, 1),
        'capability': f'{props.major}.{props.minor}', 'cuda': torch.version.cuda,
        'cudnn': torch.backends.cudnn.version(), 'driver': nvidia_driver(),
        'tf32_matmul': torch.backends.cuda.matmul.allow_tf32, 'tf32_cudnn': torch.backends.cudnn.allow_tf32,
        'cudnn_benchmark': torch.backends.cudnn.benchmark,
    }


# --- models ----------------------------------------------------------------------------------------------
class EncoderLayer(torch.nn.Module):
    """A BERT encoder layer (post-LayerNorm, GELU, no dropout) whose six projections are torch.nn.Linear."""

    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.query = torch.nn.Linear(hidden, hidden)
        self.key = torch.nn.Linear(hidden, hidden)
        self.value = torch.nn.Linear(hidden, hidden)
        self.attention_output = torch.nn.Linear(hidden, hidden)
        self.attention_norm = torch.nn.LayerNorm(hidden)
        self.intermediate = torch.nn.Linear(hidden, ffn)
        self.output = torch.nn.Linear(ffn, hidden)
        self.output_norm = torch.nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape  # [batch, sequence, hidden]

        def split(t: torch.Tensor) -> torch.Tensor:  # [batch, heads, sequence, hidden / heads]
            return t.view(b, s, self.heads, h // self.heads).transpose(1, 2)

        context = torch.nn.functional.scaled_dot_product_attention(split(self.query(x)), split(self.key(x)),
                                                                   split(self.value(x)))
        x = self.attention_norm(x + self.attention_output(context.transpose(1, 2).reshape(b, s, h)))
        return self.output_norm(x + self.output(torch.nn.functional.gelu(self.intermediate(x))))


class BertEncoder(torch.nn.Module):
    """Token and position embeddings, LayerNorm, `layers` EncoderLayers and a per-token Linear classifier."""

    def __init__(self, layers: int, hidden: int, heads: int, ffn: int, seq_len: int, vocab: int,
                 classes: int) -> None:
        super().__init__()
        self.token_embedding = torch.nn.Embedding(vocab, hidden)
        self.position_embedding = torch.nn.Embedding(seq_len, hidden)
        self.embedding_norm = torch.nn.LayerNorm(hidden)
        self.layers = torch.nn.ModuleList(EncoderLayer(hidden, heads, ffn) for _ in range(layers))
        self.classifier = torch.nn.Linear(hidden, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens [batch, sequence] -> [batch, sequence, classes]
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embedding_norm(self.token_embedding(tokens) + self.position_embedding(positions))
        for layer in self.layers:
            x = layer(x)
        return self.classifier(x)


def build_model(model_name: str, args: argparse.Namespace) -> torch.nn.Module:
    if model_name in FMNIST_MODELS:
        return fmnist_models.get_model(model_name, args.depth, args.width)
    if model_name == 'resnet50':
        import torchvision
        if args.quick:
            from torchvision.models.resnet import Bottleneck, ResNet
            return ResNet(Bottleneck, [1, 1, 1, 1], num_classes=args.classes, width_per_group=16)
        return torchvision.models.resnet50(num_classes=args.classes)
    return BertEncoder(args.bert_layers, args.bert_hidden, args.bert_heads, args.bert_ffn, args.seq_len, args.vocab,
                       args.bert_classes)


def describe_model(model_name: str, args: argparse.Namespace) -> str:
    if model_name == 'cnn':
        return 'cnn'
    if model_name == 'resnet':
        return f'resnet{args.depth} width {args.width}'
    if model_name == 'resnet50':
        body = ('ResNet(Bottleneck, [1, 1, 1, 1], width_per_group 16) (quick)' if args.quick
                else 'torchvision resnet50')
        return (f'{body}, {args.classes} classes, batch {batch_size(args, model_name)} of synthetic '
                f'3x{args.image_size}x{args.image_size} images')
    return (f'BERT-shaped encoder: {args.bert_layers} layers, hidden {args.bert_hidden}, {args.bert_heads} heads, '
            f'FFN {args.bert_ffn}, sequence {args.seq_len}, vocabulary {args.vocab}, per-token {args.bert_classes}'
            f'-class head, batch {batch_size(args, model_name)}{" (quick)" if args.quick else ""}')


def preconditioned_layers(model: torch.nn.Module) -> int:
    return sum(isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)) for m in model.modules())


# --- data and methods -------------------------------------------------------------------------------------
def make_batches(args: argparse.Namespace,
                 model_name: str = 'cnn') -> tuple[list[tuple[torch.Tensor, torch.Tensor]], str]:
    generator = torch.Generator().manual_seed(args.seed)
    b = batch_size(args, model_name)
    device = torch.device(args.device)
    if model_name == 'resnet50':
        n = args.batches or 4
        batches = [(torch.randn(b, 3, args.image_size, args.image_size, generator=generator).to(device),
                    torch.randint(0, args.classes, (b,), generator=generator).to(device)) for _ in range(n)]
        return batches, (f'synthetic N(0,1) 3x{args.image_size}x{args.image_size}, {args.classes} classes, {n} '
                         f'batches of {b}, cycled')
    if model_name == 'bert':
        n = args.batches or 4
        batches = [(torch.randint(0, args.vocab, (b, args.seq_len), generator=generator).to(device),
                    torch.randint(0, args.bert_classes, (b, args.seq_len), generator=generator).to(device))
                   for _ in range(n)]
        return batches, (f'synthetic uniform tokens (vocabulary {args.vocab}), sequence {args.seq_len}, '
                         f'{args.bert_classes}-class per-token targets, {n} batches of {b}, cycled')
    n = args.batches or 16
    if args.data == 'real':
        try:
            from fashion_mnist_resnet import load_split, normalise
            images, labels = load_split(args.data_dir, 'train')
            order = torch.randperm(len(labels), generator=generator)[:n * b]
            batches = [(normalise(images[idx]).to(device), labels[idx].to(device)) for idx in order.split(b)]
            return batches, f'Fashion-MNIST train, {len(batches)} batches of {b}, cycled'
        except FileNotFoundError as error:
            print(f'note: {error}; using random data', file=sys.stderr)
    batches = [(torch.randn(b, 1, 28, 28, generator=generator).to(device),
                torch.randint(0, 10, (b,), generator=generator).to(device)) for _ in range(n)]
    return batches, f'random N(0,1) 1x28x28, {len(batches)} batches of {b}, cycled'


def import_backends(args: argparse.Namespace) -> dict[str, Any]:
    backends: dict[str, Any] = {}
    if not args.no_dkfac:
        try:
            import dkfac
            if not hasattr(dkfac, 'KFACPreconditioner'):  # e.g. a build's python/dkfac before its build ended
                del sys.modules['dkfac']
                raise ImportError(f'{list(dkfac.__path__)} holds no built dkfac')
        except ImportError:
            sys.path.insert(0, str(REPO / 'build' / 'python'))
            import dkfac
        backends['dkfac'] = dkfac
    if args.kfac_pytorch_src:
        sys.path.insert(0, os.path.abspath(args.kfac_pytorch_src))
        with warnings.catch_warnings():
            warnings.filterwarnings('ignore', message='NVIDIA Apex is not installed')
            import kfac
        backends['kfac_pytorch'] = kfac
    return backends


class Runner:
    """One method's model, optimizer and preconditioner, stepping through the shared batches."""

    def __init__(self, method: str, model_name: str, interval: tuple[int, int] | None, args: argparse.Namespace,
                 batches: list, backends: dict[str, Any], extra_options: dict[str, Any] | None = None) -> None:
        self.method, self.batches, self.index = method, batches, 0
        self.cuda = args.device == 'cuda'
        self.set_to_none = not args.keep_gradients
        torch.manual_seed(args.seed)
        if model_name in SYNTHETIC_MODELS:
            with torch.device(args.device):  # initialised where they run (BERT-Large: 340M parameters)
                self.model = build_model(model_name, args)
        else:
            self.model = build_model(model_name, args).to(args.device)
        self.model.train()
        lr = lr_for(args, model_name)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
        self.preconditioner = None
        if method != 'sgd':
            kfac = backends[method]
            options = dict(factor_update_steps=interval[0], inv_update_steps=interval[1], damping=args.damping,
                           factor_decay=args.factor_decay, kl_clip=args.kl_clip, lr=lr,
                           compute_method=kfac.enums.ComputeMethod.EIGEN, inv_dtype=torch.float32)
            if method == 'dkfac':  # kfac_pytorch v0.4.2 registers Linear and Conv2d only: the same layers here
                options['skip_layers'] = ['Embedding']
            options.update(extra_options or {})  # a variant's settings (bench/step_kinds.py --variant)
            self.preconditioner = kfac.preconditioner.KFACPreconditioner(self.model, **options)
        self.has_phases = hasattr(self.preconditioner, 'phase_times')
        self.last_loss: torch.Tensor | None = None
        self.pending: list[list[torch.cuda.Event]] = []  # CUDA: each recorded step's events, read after the window

    @property
    def loss(self) -> float:
        return math.nan if self.last_loss is None else float(self.last_loss)

    def step(self, record: dict[str, list[float]] | None) -> None:
        if self.cuda:
            return self.step_cuda(record)
        data, target = self.batches[self.index % len(self.batches)]
        self.index += 1
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=self.set_to_none)
        loss = torch.nn.functional.cross_entropy(self.model(data).flatten(0, -2), target.flatten())
        loss.backward()
        t1 = time.perf_counter()
        if self.preconditioner is not None:
            self.preconditioner.step()
        t2 = time.perf_counter()
        self.optimizer.step()
        t3 = time.perf_counter()
        self.last_loss = loss.detach()
        if record is not None:
            record['step'].append(t3 - t0)
            record['forward_backward'].append(t1 - t0)
            record['kfac_step'].append(t2 - t1)
            record['optimizer'].append(t3 - t2)
            if self.has_phases:
                for phase, seconds in self.preconditioner.phase_times().items():
                    record.setdefault(phase, []).append(seconds)

    def step_cuda(self, record: dict[str, list[float]] | None) -> None:
        """The same step with CUDA events between its parts; nothing here waits for the device."""
        data, target = self.batches[self.index % len(self.batches)]
        self.index += 1
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)] if record is not None else None
        if events:
            events[0].record()
        self.optimizer.zero_grad(set_to_none=self.set_to_none)
        loss = torch.nn.functional.cross_entropy(self.model(data).flatten(0, -2), target.flatten())
        loss.backward()
        if events:
            events[1].record()
        if self.preconditioner is not None:
            self.preconditioner.step()
        if events:
            events[2].record()
        self.optimizer.step()
        if events:
            events[3].record()
            self.pending.append(events)
        self.last_loss = loss.detach()

    def read_events(self, record: dict[str, list[float]]) -> None:
        """CUDA, after synchronising: the pending steps' times (elapsed_time is in milliseconds)."""
        for e in self.pending:
            record['step'].append(e[0].elapsed_time(e[3]) / 1000)
            record['forward_backward'].append(e[0].elapsed_time(e[1]) / 1000)
            record['kfac_step'].append(e[1].elapsed_time(e[2]) / 1000)
            record['optimizer'].append(e[2].elapsed_time(e[3]) / 1000)
        self.pending.clear()

    def window(self, steps: int, record: dict[str, list[float]]) -> float:
        """Runs `steps` steps; returns the wall time per step."""
        gc.collect()
        if not self.cuda:
            start = time.perf_counter()
            for _ in range(steps):
                self.step(record)
            return (time.perf_counter() - start) / steps
        torch.cuda.synchronize()
        before = self.preconditioner.phase_times(total=True) if self.has_phases else {}
        start = time.perf_counter()
        for _ in range(steps):
            self.step(record)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        self.read_events(record)
        if self.has_phases:
            after = self.preconditioner.phase_times(total=True)
            for phase, total in after.items():
                record.setdefault(phase, []).append((total - before.get(phase, 0.0)) / steps)
        return seconds / steps


# --- statistics and output --------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary(values: list[float]) -> dict[str, float]:
    """mean, median and p90 in milliseconds."""
    if not values:
        return {'mean': math.nan, 'median': math.nan, 'p90': math.nan}
    return {'mean': 1000 * statistics.fmean(values), 'median': 1000 * statistics.median(values),
            'p90': 1000 * percentile(values, 90)}


def window_means(values: list[float]) -> dict[str, float]:
    """CUDA phases: values are per-window means of equally long windows; their mean is the mean per step."""
    return {'mean': 1000 * statistics.fmean(values) if values else math.nan, 'median': math.nan, 'p90': math.nan}


def fmt(value: float, width: int = 7) -> str:
    if value is None or math.isnan(value):
        return '-'.rjust(width)
    return (f'{value:.1f}' if abs(value) >= 10 else f'{value:.2f}').rjust(width)


def triple(s: dict[str, float]) -> str:
    return f"{fmt(s['mean'], 6)} /{fmt(s['median'], 6)} /{fmt(s['p90'], 6)}"


def mib(n: int | None) -> float | None:
    return None if n is None else n / 2**20


def fmt_mib(n: int | None, width: int = 7) -> str:
    return fmt(math.nan if n is None else n / 2**20, width)


def registered_layers(preconditioner: Any) -> int | None:
    """How many layers a preconditioner registered (dkfac: _names; kfac_pytorch v0.4.2: _layers)."""
    for attribute in ('_names', '_layers'):
        if hasattr(preconditioner, attribute):
            return len(getattr(preconditioner, attribute))
    return None


def entry_of(runner: Runner, windows: list[float], rec: dict[str, list[float]], cuda: bool) -> dict[str, Any]:
    entry = {
        'amortised_ms': {'median': 1000 * statistics.median(windows), 'p90': 1000 * percentile(windows, 90),
                         'windows': [1000 * w for w in windows]},
        'per_step_ms': summary(rec['step']),
        'splits_ms': {k: summary(rec[k]) for k in SPLITS},
        'measured_steps': len(rec['step']),
        'final_loss': runner.loss,
    }
    if runner.method != 'sgd' and runner.has_phases:
        entry['phases_ms'] = {p: (window_means if cuda else summary)(rec.get(p, [])) for p in DKFAC_PHASES}
    return entry


def finish(result: dict[str, Any]) -> None:
    """Overheads against plain SGD and dkfac / kfac_pytorch, for the methods that ran."""
    ok = {m: e for m, e in result['methods'].items() if 'error' not in e}
    if 'sgd' not in ok:
        return
    base = ok['sgd']['amortised_ms']['median']
    for entry in ok.values():
        entry['overhead_ms'] = entry['amortised_ms']['median'] - base
        entry['x_sgd'] = entry['amortised_ms']['median'] / base
        if entry.get('peak_memory_bytes') is not None and ok['sgd'].get('peak_memory_bytes') is not None:
            entry['kfac_memory_bytes'] = entry['peak_memory_bytes'] - ok['sgd']['peak_memory_bytes']
    if 'dkfac' in ok and 'kfac_pytorch' in ok:
        theirs = ok['kfac_pytorch']['overhead_ms']
        result['overhead_ratio_dkfac_to_kfac_pytorch'] = (ok['dkfac']['overhead_ms'] / theirs
                                                           if theirs > 0 else math.nan)
        d, k = ok['dkfac'].get('kfac_memory_bytes'), ok['kfac_pytorch'].get('kfac_memory_bytes')
        if d is not None and k is not None:
            result['kfac_memory_ratio_dkfac_to_kfac_pytorch'] = d / k if k > 0 else math.nan


def measure(model_name: str, interval: tuple[int, int], methods: list[str], plain: Runner,
            args: argparse.Namespace, batches: list, backends: dict[str, Any], log) -> dict[str, Any]:
    """The interleaved schedule: all methods alive, their windows alternating."""
    periods = max(1, math.ceil(args.min_window_steps / interval[1]))
    steps = periods * interval[1]
    runners = {'sgd': plain}
    for method in methods:
        if method == 'sgd':
            continue
        runners[method] = Runner(method, model_name, interval, args, batches, backends)
        for _ in range(args.warmup):
            runners[method].step(None)
    for name, extra in getattr(args, 'variants', {}).items():  # dkfac with other options
        runners[name] = Runner('dkfac', model_name, interval, args, batches, backends, extra)
        for _ in range(args.warmup):
            runners[name].step(None)
    records = {m: {k: [] for k in ('step',) + SPLITS} for m in runners}
    windows: dict[str, list[float]] = {m: [] for m in runners}
    order = list(runners)
    for repeat in range(args.repeats):
        rotated = order[repeat % len(order):] + order[:repeat % len(order)]
        for method in rotated:
            n = min(steps, args.plain_steps) if method == 'sgd' else steps
            windows[method].append(runners[method].window(n, records[method]))
        log(f'  {model_name} ({interval[0]},{interval[1]}) repeat {repeat + 1}/{args.repeats}: ' + ', '.join(
            f'{m} {1000 * windows[m][-1]:.1f} ms' for m in order) + f'  [load {load_average()}]')
    result: dict[str, Any] = {'model': model_name, 'factor_update_steps': interval[0],
                              'inv_update_steps': interval[1], 'window_steps': steps,
                              'plain_window_steps': min(steps, args.plain_steps), 'methods': {}}
    for method, runner in runners.items():
        result['methods'][method] = entry_of(runner, windows[method], records[method], args.device == 'cuda')
    finish(result)
    return result


def release() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def measure_alone(method: str, model_name: str, interval: tuple[int, int] | None, steps: int,
                  args: argparse.Namespace, batches: list, backends: dict[str, Any], log) -> dict[str, Any]:
    """The sequential schedule's unit: one method alone, from construction to release, with its peak memory."""
    label = f"  {model_name} {'(%d,%d)' % interval if interval else 'plain'} {method}"
    release()
    cuda = args.device == 'cuda'
    runner = None
    try:
        runner = Runner(method, model_name, interval, args, batches, backends)
        for _ in range(args.warmup):
            runner.step(None)
        rec: dict[str, list[float]] = {k: [] for k in ('step',) + SPLITS}
        windows: list[float] = []
        spent = 0.0
        for repeat in range(args.repeats):
            if repeat > 0 and args.budget_s > 0 and spent + windows[-1] * steps > args.budget_s:
                break
            windows.append(runner.window(steps, rec))
            spent += windows[-1] * steps
            log(f'{label} window {repeat + 1}/{args.repeats}: {1000 * windows[-1]:.1f} ms per step over {steps} steps'
                f'  [load {load_average()}]')
        entry = entry_of(runner, windows, rec, cuda)
        if not math.isfinite(entry['final_loss']):
            log(f'{label}: warning: the loss is {entry["final_loss"]} (a diverged run; its timings may not be typical)')
        entry['peak_memory_bytes'] = torch.cuda.max_memory_allocated() if cuda else None
        entry['linear_conv_layers'] = preconditioned_layers(runner.model)
        if runner.preconditioner is not None:
            entry['memory_usage_bytes'] = int(runner.preconditioner.memory_usage()['total'])
            entry['registered_layers'] = registered_layers(runner.preconditioner)
        return entry
    except Exception as error:  # noqa: BLE001 -- one configuration failing (e.g. out of memory) is reported
        log(f'{label}: {type(error).__name__}: {error}')
        return {'error': f'{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ""}'}
    finally:
        del runner
        release()


def measure_sequential(model_name: str, methods: list[str], args: argparse.Namespace, batches: list,
                       backends: dict[str, Any], log, done) -> None:
    """The sequential schedule for one model: plain SGD once, then each interval's K-FAC methods alone."""
    sgd = measure_alone('sgd', model_name, None, args.plain_steps, args, batches, backends, log)
    for interval in args.intervals:
        steps = max(1, math.ceil(args.min_window_steps / interval[1])) * interval[1]
        result: dict[str, Any] = {'model': model_name, 'factor_update_steps': interval[0],
                                  'inv_update_steps': interval[1], 'window_steps': steps,
                                  'plain_window_steps': args.plain_steps, 'methods': {'sgd': sgd}}
        for method in methods[1:]:
            result['methods'][method] = measure_alone(method, model_name, interval, steps, args, batches, backends,
                                                      log)
        finish(result)
        done(result)


def conditions(env: dict[str, Any], args: argparse.Namespace) -> str:
    if args.device == 'cpu':
        batch = f"batch {env['batch_size']}" if isinstance(env['batch_size'], int) else 'batch ' + ', '.join(
            f'{b} ({m})' for m, b in env['batch_size'].items())
        return (f"{batch}, {env['torch_threads']} torch threads (BLAS: {env['blas']}), allocator: "
                f"{env['allocator']}")
    batch = ', '.join(f'{b} ({m})' for m, b in env['batch_size'].items()) if isinstance(env['batch_size'], dict) \
        else str(env['batch_size'])
    return (f"batch {batch}, {env['gpu']['device']}, torch {env['torch']} CUDA {env['gpu']['cuda']}, TF32 matmul "
            f"{env['gpu']['tf32_matmul']} / cuDNN {env['gpu']['tf32_cudnn']}, {env['torch_threads']} torch threads")


def report(results: list[dict[str, Any]], env: dict[str, Any], args: argparse.Namespace) -> str:
    lines = []
    lines.append('python_step: ' + json.dumps(env, sort_keys=True))
    cond = conditions(env, args)
    cuda = args.device == 'cuda'
    lines.append('')
    lines.append('Step time, ms. amortised = window time / window steps over whole inverse periods: median / p90 '
                 f'over {args.repeats} repeats; per step = mean / median / p90 over all measured steps.'
                 + (' CUDA: windows between torch.cuda.synchronize() calls, per step from CUDA events.'
                    if cuda else ''))
    lines.append(f'Conditions on every row: {cond}; {env["data"]}; eigen, damping {args.damping}, lr {lr_text(args)}, '
                 f'kl_clip {args.kl_clip}, factor_decay {args.factor_decay}, float32 inverses; one process.')
    head = (f"{'model':<10}{'(f,inv)':<9}{'method':<14}{'window':>9}{'amortised med/p90':>20}"
            f"{'per step mean/med/p90':>26}{'fwd+bwd med':>12}{'kfac.step mean':>15}{'overhead':>10}{'x SGD':>7}"
            f"{'loss':>8}")
    lines.append(head)
    for r in results:
        for method, e in r['methods'].items():
            where = f"{r['model']:<10}{'(%d,%d)' % (r['factor_update_steps'], r['inv_update_steps']):<9}{method:<14}"
            if 'error' in e:
                lines.append(f"{where}   failed: {e['error']}")
                continue
            windows = len(e['amortised_ms']['windows'])
            window = f"{e['measured_steps'] // windows}x{windows}"
            lines.append(
                f"{where}{window:>9}{fmt(e['amortised_ms']['median'], 9)} /{fmt(e['amortised_ms']['p90'], 8)}"
                f"   {triple(e['per_step_ms'])}{fmt(e['splits_ms']['forward_backward']['median'], 12)}"
                f"{fmt(e['splits_ms']['kfac_step']['mean'], 15)}{fmt(e.get('overhead_ms', math.nan), 10)}"
                f"{e.get('x_sgd', math.nan):7.2f}{e['final_loss']:8.4f}")
    lines.append('')
    lines.append("dkfac's phases (and each --variant's: phase_times()), ms per step: mean (amortised) / median / p90 "
                 "over the measured steps"
                 + (' (CUDA: the mean from phase_times(total=True) per window)' if cuda else ''))
    lines.append(f"{'model':<10}{'(f,inv)':<9}{'method':<14}" + ''.join(f'{p:>24}' for p in DKFAC_PHASES))
    for r in results:
        for method, e in r['methods'].items():
            if 'phases_ms' in e:
                lines.append(f"{r['model']:<10}{'(%d,%d)' % (r['factor_update_steps'], r['inv_update_steps']):<9}"
                             f"{method:<14}" + ''.join(f'{triple(e["phases_ms"][p]):>24}' for p in DKFAC_PHASES))
    lines.append('')
    lines.append('Per-step splits, ms: mean (amortised) / median / p90 over the measured steps '
                 '(kfac_pytorch builds its factors in the forward/backward hooks, dkfac in step())')
    lines.append(f"{'model':<10}{'(f,inv)':<9}{'method':<14}" + ''.join(f'{s:>24}' for s in SPLITS))
    for r in results:
        for method, e in r['methods'].items():
            if 'error' in e:
                continue
            lines.append(f"{r['model']:<10}{'(%d,%d)' % (r['factor_update_steps'], r['inv_update_steps']):<9}"
                         f"{method:<14}" + ''.join(f'{triple(e["splits_ms"][s]):>24}' for s in SPLITS))
    ratios = [r for r in results if 'overhead_ratio_dkfac_to_kfac_pytorch' in r]
    if ratios:
        lines.append('')
        lines.append('K-FAC overhead (amortised step - plain SGD step, medians), ms, and dkfac / kfac_pytorch:')
        for r in ratios:
            d, k = r['methods']['dkfac']['overhead_ms'], r['methods']['kfac_pytorch']['overhead_ms']
            ratio = r['overhead_ratio_dkfac_to_kfac_pytorch']
            verdict = 'yes' if ratio <= 0.5 else 'no'
            lines.append(f"  {r['model']:<8} ({r['factor_update_steps']},{r['inv_update_steps']}) [{cond}]: dkfac "
                         f"{d:.1f} ms, kfac_pytorch {k:.1f} ms, ratio {ratio:.2f}; at most half: {verdict}")
    if args.schedule == 'sequential':
        lines.extend(memory_report(results, cuda))
    return '\n'.join(lines)


def memory_report(results: list[dict[str, Any]], cuda: bool) -> list[str]:
    """The sequential schedule's memory table and the goal's verdict lines (memory on CUDA only)."""
    lines = ['', 'Memory, MiB: peak = torch.cuda.max_memory_allocated() of the method alone (data batches included), '
             'K-FAC = peak - plain SGD\'s peak, memory_usage() = the preconditioner\'s own count (total)'
             + ('' if cuda else ' (CPU: not measured)')]
    lines.append(f"{'model':<10}{'(f,inv)':<9}{'method':<14}{'peak':>10}{'K-FAC':>10}{'memory_usage()':>16}"
                 f"{'registered':>12}{'of':>8}  (layers: registered by the preconditioner, of the model's "
                 "Linear and Conv2d)")
    for r in results:
        for method, e in r['methods'].items():
            if 'error' in e:
                continue
            lines.append(f"{r['model']:<10}{'(%d,%d)' % (r['factor_update_steps'], r['inv_update_steps']):<9}"
                         f"{method:<14}{fmt_mib(e.get('peak_memory_bytes'), 10)}"
                         f"{fmt_mib(e.get('kfac_memory_bytes'), 10)}{fmt_mib(e.get('memory_usage_bytes'), 16)}"
                         f"{e.get('registered_layers') or '-':>12}{e['linear_conv_layers']:>8}")
    lines.append('')
    for r in results:
        lines.append('verdict: ' + verdict(r))
    return lines


def verdict(r: dict[str, Any]) -> str:
    """One line on the goal: dkfac's overhead at most 0.5x kfac_pytorch's, its K-FAC memory no larger."""
    where = f"{r['model']} ({r['factor_update_steps']},{r['inv_update_steps']})"
    failed = [m for m, e in r['methods'].items() if 'error' in e]
    if failed:
        return f"{where}: not measured ({', '.join(f'{m} failed' for m in failed)})"
    if 'overhead_ratio_dkfac_to_kfac_pytorch' not in r:
        return f'{where}: not measured (needs dkfac and kfac_pytorch)'
    ratio = r['overhead_ratio_dkfac_to_kfac_pytorch']
    text = f"{where}: overhead ratio {ratio:.2f} (goal <= 0.5: {'met' if ratio <= 0.5 else 'not met'})"
    d, k = r['methods']['dkfac'].get('kfac_memory_bytes'), r['methods']['kfac_pytorch'].get('kfac_memory_bytes')
    if d is None or k is None:
        return text + '; K-FAC memory not measured'
    return (text + f"; K-FAC memory dkfac {mib(d):.0f} MiB, kfac_pytorch {mib(k):.0f} MiB "
            f"(goal no larger: {'met' if d <= k else 'not met'})")


def markdown(results: list[dict[str, Any]], env: dict[str, Any], args: argparse.Namespace) -> str:
    """A table per run: what docs/PERFORMANCE.md takes (step times, overhead, memory, ratios)."""
    where = (f"{env['gpu']['device']}, driver {env['gpu']['driver'] or '?'}, torch {env['torch']}, CUDA "
             f"{env['gpu']['cuda']}" if args.device == 'cuda' else f"{env['cpu']}, {env['cores']} cores, torch "
             f"{env['torch']}")
    lines = [f"### bench/python_step.py on {where}", '',
             f"{conditions(env, args)}; {args.schedule} schedule, warm-up {args.warmup} steps, windows of whole "
             f"inverse periods (at least {args.min_window_steps} steps), up to {args.repeats} per configuration"
             + (f' within {args.budget_s:g} s' if args.budget_s > 0 and args.schedule == 'sequential' else '')
             + f"; eigen, damping {args.damping}, lr {lr_text(args)}, kl_clip {args.kl_clip}, float32 inverses. "
             + "Models: "
             + '; '.join(f'{m}: {describe_model(m, args)}' for m in args.models) + '.', '',
             '| model | (f, inv) | method | step mean (ms) | median | p90 | steps | overhead (ms) | x SGD '
             '| peak memory (MiB) | K-FAC memory (MiB) | memory_usage() (MiB) | layers |',
             '|---|---|---|---|---|---|---|---|---|---|---|---|---|']
    for r in results:
        for method, e in r['methods'].items():
            cells = [r['model'], f"({r['factor_update_steps']}, {r['inv_update_steps']})", method]
            if 'error' in e:
                lines.append('| ' + ' | '.join(cells + [f"failed: {e['error']}"] + [''] * 9) + ' |')
                continue
            s = e['per_step_ms']
            cells += [fmt(s['mean'], 0), fmt(s['median'], 0), fmt(s['p90'], 0), str(e['measured_steps']),
                      fmt(e.get('overhead_ms', math.nan), 0) if method != 'sgd' else '',
                      f"{e.get('x_sgd', math.nan):.2f}",
                      fmt_mib(e.get('peak_memory_bytes'), 0),
                      fmt_mib(e.get('kfac_memory_bytes'), 0) if method != 'sgd' else '',
                      fmt_mib(e.get('memory_usage_bytes'), 0) if method != 'sgd' else '',
                      f"{e.get('registered_layers') or '-'} of {e.get('linear_conv_layers', '-')}"]
            lines.append('| ' + ' | '.join(cells) + ' |')
    lines += ['', "Goal (issue 24): dkfac's K-FAC overhead at most 0.5x kfac_pytorch's, its K-FAC memory no larger.",
              '']
    lines += [f'- {verdict(r)}' for r in results]
    return '\n'.join(lines) + '\n'


def dump_json(path: str, content: Any) -> None:
    """Writes `content` to `path` whole or not at all (a run stopped while writing keeps the previous file)."""
    with open(path + '.tmp', 'w') as f:
        json.dump(content, f, indent=1, sort_keys=True)
    os.replace(path + '.tmp', path)


def write_json(path: str, env: dict[str, Any], results: list[dict[str, Any]], partial: bool) -> None:
    content: dict[str, Any] = {'environment': env, 'results': results}
    if partial:
        content['partial'] = True  # rewritten after every configuration; the final file has no such key
    dump_json(path, content)


def write_outputs(tool: str, args: argparse.Namespace, env: dict[str, Any], results: list[dict[str, Any]],
                  text: str, table: str) -> None:
    """The end of a run: the report on standard output, the final --json file and the --markdown table."""
    print(text)
    if args.json:
        write_json(args.json, env, results, partial=False)
        print(f'\n{tool}: {args.json}')
    if args.markdown:
        with open(args.markdown, 'w') as f:
            f.write(table)
        print(f'{tool}: {args.markdown}')


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    backends = import_backends(args)
    allocator = 'glibc defaults'
    if args.configure_allocator:
        allocator = backends['dkfac'].configure_allocator() if 'dkfac' in backends else 'dkfac not loaded'
    batch_sets: dict[str, tuple[list, str]] = {}
    for m in args.models:
        shared = next((k for k in batch_sets if k in FMNIST_MODELS and m in FMNIST_MODELS
                       and batch_size(args, k) == batch_size(args, m)), None)
        batch_sets[m] = batch_sets[shared] if shared else make_batches(args, m)
    data_names = list(dict.fromkeys(d for _, d in batch_sets.values()))
    batches_by_size = {m: batch_size(args, m) for m in args.models}
    methods = ['sgd'] + [m for m in METHODS[1:] if m in backends]
    env = {
        'cpu': cpu_model(), 'cores': os.cpu_count(), 'affinity': len(os.sched_getaffinity(0)),
        'torch': torch.__version__, 'torch_threads': torch.get_num_threads(),
        'interop_threads': torch.get_num_interop_threads(),
        'blas': 'MKL' if torch.backends.mkl.is_available() else 'not MKL', 'allocator': allocator,
        'python': platform.python_version(), 'dkfac': getattr(backends.get('dkfac'), '__version__', None),
        'kfac_pytorch': getattr(backends.get('kfac_pytorch'), '__version__', None),
        'kfac_pytorch_src': os.path.abspath(args.kfac_pytorch_src) if args.kfac_pytorch_src else None,
        'batch_size': (next(iter(batches_by_size.values())) if len(set(batches_by_size.values())) == 1
                       else batches_by_size),
        'data': '; '.join(data_names), 'models': args.models,
        'resnet': f'resnet{args.depth} width {args.width}', 'seed': args.seed, 'repeats': args.repeats,
        'warmup': args.warmup, 'quick': args.quick, 'load_average_start': load_average(),
        'device': args.device,
    }
    if args.device == 'cuda':
        env['gpu'] = cuda_environment()
    if any(m in SYNTHETIC_MODELS for m in args.models) or args.schedule != 'interleaved':
        env.update(schedule=args.schedule, budget_s=args.budget_s, min_window_steps=args.min_window_steps,
                   plain_steps=args.plain_steps, intervals=[list(i) for i in args.intervals])
    if args.device == 'cpu' and all(m in FMNIST_MODELS for m in args.models) and args.schedule == 'interleaved':
        del env['device']  # the CPU run's environment as before these options
    else:
        env['models_desc'] = {m: describe_model(m, args) for m in args.models}

    where = (f"{env['gpu']['device']} ({env['gpu']['device_memory_gib']} GiB, driver {env['gpu']['driver']}, "
             f"CUDA {env['gpu']['cuda']}), " if args.device == 'cuda' else '')
    log(f"python_step: {where}{env['cpu']}, {env['cores']} cores, torch {env['torch']} with {env['torch_threads']} "
        f"threads, BLAS {env['blas']}, allocator {allocator}, dkfac {env['dkfac']}, kfac_pytorch "
        f"{env['kfac_pytorch']}; methods {methods}")
    started = time.perf_counter()
    results: list[dict[str, Any]] = []

    def done(result: dict[str, Any]) -> None:
        results.append(result)
        if args.json:
            write_json(args.json, env, results, partial=True)

    for model_name in args.models:
        batches = batch_sets[model_name][0]
        if args.schedule == 'sequential':
            measure_sequential(model_name, methods, args, batches, backends, log, done)
            continue
        plain = Runner('sgd', model_name, None, args, batches, backends)
        for _ in range(args.warmup):
            plain.step(None)
        for interval in args.intervals:
            done(measure(model_name, interval, methods, plain, args, batches, backends, log))
    env['load_average_end'] = load_average()
    env['wall_s'] = round(time.perf_counter() - started, 1)
    write_outputs('python_step', args, env, results, report(results, env, args), markdown(results, env, args))


if __name__ == '__main__':
    main()
