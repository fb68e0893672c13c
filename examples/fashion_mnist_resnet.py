"""Fashion-MNIST and ResNet training script with K-FAC (dkfac or kfac_pytorch), DistributedDataParallel on Gloo.

Single process (no launcher: world size 1)::

    python3 examples/fashion_mnist_resnet.py --epochs 1
    python3 examples/fashion_mnist_resnet.py --max-steps 20 --kfac-backend kfac-pytorch --kfac-pytorch-src /path/to/kfac_pytorch

N local workers under torch's elastic launcher (see examples/README.md)::

    python3 examples/launch.py --nproc-per-node 2 examples/fashion_mnist_resnet.py --epochs 1
    torchrun --nproc_per_node=2 examples/fashion_mnist_resnet.py --epochs 1

The flags keep the names and meanings of kfac_pytorch's example scripts (torch_cifar10_resnet.py):
``--batch-size`` is per worker, ``--base-lr`` is scaled by the world size after a linear warm-up over
``--warmup-epochs``, ``--kfac-inv-update-steps 0`` trains without K-FAC, ``--kfac-strategy``
comm-opt/mem-opt/hybrid-opt picks the gradient-worker fraction. Added here: ``--kfac-backend``,
``--kfac-pytorch-src``, ``--dkfac-strategy``, ``--max-steps``, ``--model``/``--depth``/``--width``,
``--threads``, ``--data-dir``, ``--log-interval``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import gzip
import json
import math
import os
import socket
import statistics
import struct
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fmnist_models  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MEAN, STD = 0.2860, 0.3530  # Fashion-MNIST training-set pixel mean and std (on [0, 1])
FILES = {
    'train': ('train-images-idx3-ubyte', 'train-labels-idx1-ubyte'),
    'val': ('t10k-images-idx3-ubyte', 't10k-labels-idx1-ubyte'),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    parser = argparse.ArgumentParser(description='Fashion-MNIST ResNet example with K-FAC (dkfac or kfac_pytorch)',
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # General settings
    parser.add_argument('--data-dir', default='/usr/share/datasets/fashion-mnist',
                        help='directory holding the Fashion-MNIST idx files (gzipped or not)')
    parser.add_argument('--log-dir', default=None,
                        help='checkpoint and metrics directory (resumes from the newest checkpoint in it); '
                        'none: nothing is written')
    parser.add_argument('--checkpoint-format', default='checkpoint_{epoch}.pth.tar', help='checkpoint file format')
    parser.add_argument('--checkpoint-freq', type=int, default=10, help='epochs between checkpoints')
    parser.add_argument('--seed', type=int, default=42, help='random seed')
    parser.add_argument('--threads', type=int, default=0,
                        help='torch threads per worker (0: cores / local workers)')
    parser.add_argument('--log-interval', type=int, default=50, help='training steps between log lines')

    # Model
    parser.add_argument('--model', default='resnet', choices=['resnet', 'cnn'], help='model')
    parser.add_argument('--depth', type=int, default=14, help='ResNet depth, 6n + 2 (8, 14, 20, ...)')
    parser.add_argument('--width', type=int, default=16,
                        help='ResNet first-stage width (stages: w, 2w, 4w; 4w <= 256)')

    # Training settings
    parser.add_argument('--batch-size', type=int, default=128, help='input batch size per worker for training')
    parser.add_argument('--val-batch-size', type=int, default=256, help='input batch size per worker for validation')
    parser.add_argument('--epochs', type=int, default=10, help='number of epochs to train')
    parser.add_argument('--max-steps', type=int, default=0,
                        help='stop after this many optimizer steps in all (0: no limit), then validate')
    parser.add_argument('--base-lr', type=float, default=0.1, help='base learning rate (per worker; x world size)')
    parser.add_argument('--lr-decay', nargs='+', type=int, default=[5, 8],
                        help='epochs after which the lr is multiplied by 0.1')
    parser.add_argument('--warmup-epochs', type=int, default=1,
                        help='epochs of linear warm-up from base-lr to base-lr x world size')
    parser.add_argument('--momentum', type=float, default=0.9, help='SGD momentum')
    parser.add_argument('--weight-decay', type=float, default=5e-4, help='SGD weight decay')
    parser.add_argument('--label-smoothing', type=float, default=0.0, help='label smoothing')
    parser.add_argument('--augment', action=argparse.BooleanOptionalAction, default=True,
                        help='random 2-pixel shifts and horizontal flips of training images')

    # KFAC Parameters
    parser.add_argument('--kfac-backend', default='dkfac', choices=['dkfac', 'kfac-pytorch'],
                        help='K-FAC implementation: dkfac, or kfac_pytorch (the reference)')
    parser.add_argument('--kfac-pytorch-src', default=None,
                        help="directory to import kfac_pytorch's 'kfac' package from (its source tree)")
    parser.add_argument('--dkfac-strategy', default='kaisa', choices=['kaisa', 'spd', 'dp'],
                        help="dkfac's distribution strategy (spd and dp need --kfac-strategy comm-opt)")
    parser.add_argument('--kfac-inv-update-steps', type=int, default=100,
                        help='iters between kfac inv ops (0 disables kfac)')
    parser.add_argument('--kfac-factor-update-steps', type=int, default=10, help='iters between kfac cov ops')
    parser.add_argument('--kfac-update-steps-alpha', type=float, default=10, help='KFAC update step multiplier')
    parser.add_argument('--kfac-update-steps-decay', nargs='+', type=int, default=None,
                        help='epochs at which the K-FAC update intervals are multiplied by the alpha')
    parser.add_argument('--kfac-inv-method', action='store_true', default=False,
                        help='use the inverse K-FAC update instead of eigen')
    parser.add_argument('--kfac-factor-decay', type=float, default=0.95, help='alpha value for factor accumulation')
    parser.add_argument('--kfac-damping', type=float, default=0.003, help='KFAC damping factor')
    parser.add_argument('--kfac-damping-alpha', type=float, default=0.5, help='KFAC damping decay factor')
    parser.add_argument('--kfac-damping-decay', nargs='+', type=int, default=None,
                        help='epochs at which the damping is multiplied by its alpha')
    parser.add_argument('--kfac-kl-clip', type=float, default=0.001, help='KL clip')
    parser.add_argument('--kfac-skip-layers', nargs='+', type=str, default=[],
                        help='layer types or names to leave out of K-FAC')
    parser.add_argument('--kfac-colocate-factors', action=argparse.BooleanOptionalAction, default=True,
                        help='compute A and G for a single layer on the same worker')
    parser.add_argument('--kfac-strategy', default='comm-opt', choices=['comm-opt', 'mem-opt', 'hybrid-opt'],
                        help='KFAC communication optimization strategy')
    parser.add_argument('--kfac-grad-worker-fraction', type=float, default=0.25,
                        help='fraction of workers that compute the gradients when using hybrid-opt')

    parser.add_argument('--backend', default='gloo', help='torch.distributed backend (dkfac needs gloo)')
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0,
                        help='local rank (set by the launcher through LOCAL_RANK)')
    args = parser.parse_args(argv)
    if 'LOCAL_RANK' in os.environ:
        args.local_rank = int(os.environ['LOCAL_RANK'])
    if args.kfac_backend != 'dkfac' and args.dkfac_strategy != 'kaisa':
        parser.error('--dkfac-strategy applies to --kfac-backend dkfac only')
    return args


# --- data -----------------------------------------------------------------------------------------------
def read_idx(path: Path) -> torch.Tensor:
    """An idx file (gzipped or not) as a uint8 tensor of its dimensions."""
    data = path.read_bytes()
    if data[:2] == b'\x1f\x8b':
        data = gzip.decompress(data)
    zero, dtype, ndim = struct.unpack('>HBB', data[:4])
    if zero != 0 or dtype != 0x08:
        raise ValueError(f'{path}: not an unsigned-byte idx file')
    dims = struct.unpack(f'>{ndim}I', data[4:4 + 4 * ndim])
    array = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if array.size != math.prod(dims):
        raise ValueError(f'{path}: {array.size} values for dimensions {dims}')
    return torch.from_numpy(array.copy()).view(*dims)


def load_split(data_dir: str, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(images N x 1 x 28 x 28 uint8, labels N int64) of 'train' or 'val'."""
    tensors = []
    for stem in FILES[split]:
        candidates = [Path(data_dir) / (stem + '.gz'), Path(data_dir) / stem,
                      Path(data_dir) / 'FashionMNIST' / 'raw' / stem]
        path = next((p for p in candidates if p.exists()), None)
        if path is None:
            raise FileNotFoundError(f'{stem}[.gz] not found in {data_dir} (Debian: apt install dataset-fashion-mnist)')
        tensors.append(read_idx(path))
    images, labels = tensors
    return images.unsqueeze(1), labels.long()


def normalise(images: torch.Tensor) -> torch.Tensor:
    """uint8 images to float32, standardised with the training set's mean and std."""
    return (images.float().div_(255.0) - MEAN).div_(STD)


def augment(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random shifts of up to 2 pixels (zero padding) and random horizontal flips of uint8 images."""
    n, _, h, w = images.shape
    padded = torch.nn.functional.pad(images, (2, 2, 2, 2))
    offsets = torch.randint(0, 5, (n, 2), generator=generator).tolist()
    out = torch.stack([padded[i, :, dy:dy + h, dx:dx + w] for i, (dy, dx) in enumerate(offsets)])
    flip = torch.rand(n, generator=generator) < 0.5
    out[flip] = out[flip].flip(-1)
    return out


# --- distributed ------------------------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port free on this host now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def init_distributed(backend: str) -> None:
    """The launcher's process group (env://), or a one-process group on a free local port without one."""
    if 'RANK' in os.environ and 'WORLD_SIZE' in os.environ:
        dist.init_process_group(backend=backend, init_method='env://')
    else:
        dist.init_process_group(backend=backend, init_method=f'tcp://127.0.0.1:{free_port()}', rank=0, world_size=1)


def import_backend(args: argparse.Namespace) -> Any:
    """The K-FAC package: dkfac (falling back to this repository's build/python) or kfac_pytorch's kfac."""
    if args.kfac_backend == 'kfac-pytorch':
        if args.kfac_pytorch_src:
            sys.path.insert(0, os.path.abspath(args.kfac_pytorch_src))
        with warnings.catch_warnings():
            warnings.filterwarnings('ignore', message='NVIDIA Apex is not installed')
            import kfac
        return kfac
    try:
        import dkfac
    except ImportError:
        sys.path.insert(0, str(REPO / 'build' / 'python'))
        import dkfac
    return dkfac


def step_scale(alpha: float, epochs: list[int] | None):
    """fn(epoch) for LambdaParamScheduler, which multiplies the current value by it at the end of every epoch:
    alpha at each given epoch, 1 otherwise (so the value is multiplied by alpha once per listed epoch)."""
    marks = set(epochs or [])
    return lambda epoch: alpha if epoch in marks else 1.0


def lr_factor(world_size: int, warmup_epochs: int, decay: list[int]):
    """LambdaLR factor at an epoch: linear warm-up 1/W -> 1 over warmup_epochs, then x0.1 at each decay epoch."""
    def factor(epoch: int) -> float:
        if epoch < warmup_epochs:
            return (1 + epoch * (world_size - 1) / warmup_epochs) / world_size
        return 0.1 ** sum(epoch >= e for e in decay)
    return factor


def make_preconditioner(kfac: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        args: argparse.Namespace) -> tuple[Any, Any]:
    """(preconditioner, K-FAC parameter scheduler), or (None, None) with --kfac-inv-update-steps 0."""
    if kfac is None or args.kfac_inv_update_steps <= 0:
        return None, None
    fractions = {
        'comm-opt': kfac.enums.DistributedStrategy.COMM_OPT,
        'mem-opt': kfac.enums.DistributedStrategy.MEM_OPT,
        'hybrid-opt': args.kfac_grad_worker_fraction,
    }
    options: dict[str, Any] = dict(
        factor_update_steps=args.kfac_factor_update_steps,
        inv_update_steps=args.kfac_inv_update_steps,
        damping=args.kfac_damping,
        factor_decay=args.kfac_factor_decay,
        kl_clip=args.kfac_kl_clip,
        lr=lambda step: optimizer.param_groups[0]['lr'],
        accumulation_steps=1,
        allreduce_bucket_cap_mb=25,
        colocate_factors=args.kfac_colocate_factors,
        compute_method=kfac.enums.ComputeMethod.INVERSE if args.kfac_inv_method else kfac.enums.ComputeMethod.EIGEN,
        grad_worker_fraction=fractions[args.kfac_strategy],
        skip_layers=args.kfac_skip_layers,
    )
    if args.kfac_backend == 'dkfac':
        options['strategy'] = args.dkfac_strategy
    preconditioner = kfac.preconditioner.KFACPreconditioner(model, **options)
    scheduler = kfac.scheduler.LambdaParamScheduler(
        preconditioner,
        damping_lambda=step_scale(args.kfac_damping_alpha, args.kfac_damping_decay),
        factor_update_steps_lambda=step_scale(args.kfac_update_steps_alpha, args.kfac_update_steps_decay),
        inv_update_steps_lambda=step_scale(args.kfac_update_steps_alpha, args.kfac_update_steps_decay),
    )
    return preconditioner, scheduler


def all_sum(values: list[float]) -> list[float]:
    """Element-wise sum over the ranks."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def evaluate(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, batch_size: int,
             loss_func: torch.nn.Module) -> tuple[float, float]:
    """(mean loss, accuracy) over the whole split, each rank taking every world-size-th example."""
    model.eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = torch.arange(rank, len(labels), world)
    loss_sum = correct = 0.0
    with torch.no_grad():
        for start in range(0, len(mine), batch_size):
            idx = mine[start:start + batch_size]
            output = model(normalise(images[idx]))
            target = labels[idx]
            loss_sum += float(loss_func(output, target)) * len(idx)
            correct += float((output.argmax(1) == target).sum())
    loss_sum, correct, count = all_sum([loss_sum, correct, float(len(mine))])
    model.train()
    return loss_sum / count, correct / count


def log(args: argparse.Namespace, *parts: Any) -> None:
    if args.verbose:
        print(*parts, flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train and evaluate; returns the final summary (rank 0 prints it as a 'final: {json}' line)."""
    args = parse_args(argv)
    started = time.time()
    init_distributed(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    args.verbose = rank == 0
    local_world = int(os.environ.get('LOCAL_WORLD_SIZE', '1'))
    threads = args.threads or max(1, (os.cpu_count() or 1) // local_world)
    torch.set_num_threads(threads)
    torch.manual_seed(args.seed)
    kfac = import_backend(args) if args.kfac_inv_update_steps > 0 else None  # plain SGD needs neither package
    using = (f'K-FAC backend {args.kfac_backend} {getattr(kfac, "__version__", "")} from {Path(kfac.__file__).parent}'
             if kfac is not None else 'no K-FAC')
    log(args, f'world size {world}, backend {args.backend}, torch {torch.__version__}, {threads} threads per worker, '
        + using)

    train_images, train_labels = load_split(args.data_dir, 'train')
    val_images, val_labels = load_split(args.data_dir, 'val')
    net = fmnist_models.get_model(args.model, args.depth, args.width)
    parameters = sum(p.numel() for p in net.parameters())
    log(args, f'model {args.model}' + (f'{args.depth} width {args.width}' if args.model == 'resnet' else '')
        + f': {parameters} parameters; train {len(train_labels)}, val {len(val_labels)} images')
    model = torch.nn.parallel.DistributedDataParallel(net) if world > 1 else net

    args.base_lr = args.base_lr * world
    optimizer = torch.optim.SGD(model.parameters(), lr=args.base_lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(world, args.warmup_epochs, args.lr_decay))
    preconditioner, kfac_scheduler = make_preconditioner(kfac, model, optimizer, args)
    log(args, preconditioner if preconditioner is not None else 'K-FAC off (--kfac-inv-update-steps 0): plain SGD')
    loss_func = torch.nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    resume_epoch = 0
    if args.log_dir:
        os.makedirs(args.log_dir, exist_ok=True)
        args.checkpoint_format = os.path.join(args.log_dir, args.checkpoint_format)
        for epoch in range(args.epochs, 0, -1):
            if os.path.exists(args.checkpoint_format.format(epoch=epoch)):
                resume_epoch = epoch
                break
    if resume_epoch > 0:
        checkpoint = torch.load(args.checkpoint_format.format(epoch=resume_epoch), map_location='cpu')
        net.load_state_dict(checkpoint['model'])
        optimizer.load_state_dict(checkpoint['optimizer'])
        lr_scheduler.load_state_dict(checkpoint['lr_scheduler'])
        if preconditioner is not None and checkpoint['preconditioner'] is not None:
            state = dict(checkpoint['preconditioner'])
            if world > 1:
                # Rank 0 saved the checkpoint. Every rank recomputes the second-order state from the saved
                # factors (a collective). dkfac builds before commit e94febc restored rank 0's own state
                # exactly on rank 0 only and recomputed on the others, which then waited for rank 0 forever.
                state.pop('dkfac', None)
            preconditioner.load_state_dict(state)
        log(args, f'resumed from epoch {resume_epoch}')

    sampler = torch.utils.data.distributed.DistributedSampler(
        torch.utils.data.TensorDataset(train_labels), num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    steps_per_epoch = math.ceil(sampler.num_samples / args.batch_size)
    generator = torch.Generator()
    step_times: list[float] = []
    phase_sums: dict[str, float] = {}
    global_step = resume_epoch * steps_per_epoch
    summary: dict[str, Any] = {}
    stop = False
    model.train()
    for epoch in range(resume_epoch + 1, args.epochs + 1):
        sampler.set_epoch(epoch)
        generator.manual_seed(args.seed * 1000003 + epoch * 1009 + rank)
        indices = torch.tensor(list(sampler))
        epoch_start = time.time()
        window = [0.0, 0.0, 0.0]  # loss sum, correct, examples since the last log line
        epoch_totals = [0.0, 0.0, 0.0]
        for batch, start in enumerate(range(0, len(indices), args.batch_size)):
            t0 = time.perf_counter()
            idx = indices[start:start + args.batch_size]
            images = train_images[idx]
            if args.augment:
                images = augment(images, generator)
            data, target = normalise(images), train_labels[idx]
            output = model(data)
            loss = loss_func(output, target)
            loss.backward()
            if preconditioner is not None:
                preconditioner.step()
            optimizer.step()
            optimizer.zero_grad()
            step_times.append(time.perf_counter() - t0)
            if preconditioner is not None and hasattr(preconditioner, 'phase_times'):
                for phase, seconds in preconditioner.phase_times().items():
                    phase_sums[phase] = phase_sums.get(phase, 0.0) + seconds
            global_step += 1
            with torch.no_grad():
                stats = [float(loss) * len(idx), float((output.argmax(1) == target).sum()), float(len(idx))]
            window = [a + b for a, b in zip(window, stats)]
            epoch_totals = [a + b for a, b in zip(epoch_totals, stats)]
            stop = 0 < args.max_steps <= global_step
            if (batch + 1) % args.log_interval == 0 or batch + 1 == steps_per_epoch or stop:
                loss_sum, correct, count = all_sum(window)
                recent = step_times[-args.log_interval:]
                log(args, f'epoch {epoch:3d}/{args.epochs} step {batch + 1:4d}/{steps_per_epoch} '
                    f'loss {loss_sum / count:.4f} acc {100 * correct / count:6.2f}% '
                    f'lr {optimizer.param_groups[0]["lr"]:.4f} step {1000 * statistics.median(recent):.1f} ms')
                window = [0.0, 0.0, 0.0]
            if stop:
                break
        val_loss, val_acc = evaluate(model, val_images, val_labels, args.val_batch_size, loss_func)
        loss_sum, correct, count = all_sum(epoch_totals)
        log(args, f'epoch {epoch:3d}/{args.epochs} train_loss {loss_sum / count:.4f} '
            f'train_acc {100 * correct / count:.2f}% val_loss {val_loss:.4f} val_acc {100 * val_acc:.2f}% '
            f'epoch time {time.time() - epoch_start:.1f} s')
        summary = {'epoch': epoch, 'steps': global_step, 'train_loss': loss_sum / count, 'train_acc': correct / count,
                   'val_loss': val_loss, 'val_acc': val_acc}
        if args.log_dir and args.verbose:
            with open(os.path.join(args.log_dir, 'metrics.jsonl'), 'a') as f:
                f.write(json.dumps(summary) + '\n')
        lr_scheduler.step()
        if kfac_scheduler is not None:
            kfac_scheduler.step(step=epoch)
        whole_epoch = batch + 1 == steps_per_epoch  # --max-steps may have stopped it early
        if args.log_dir and args.verbose and whole_epoch and (epoch % args.checkpoint_freq == 0 or epoch == args.epochs):
            torch.save({
                'model': net.state_dict(),
                'optimizer': optimizer.state_dict(),
                'preconditioner': preconditioner.state_dict() if preconditioner is not None else None,
                'lr_scheduler': lr_scheduler.state_dict(),
            }, args.checkpoint_format.format(epoch=epoch))
        if stop:
            break

    measured = step_times[1:] or step_times  # the first step pays one-off set-up
    summary.update(
        world_size=world, kfac_backend=args.kfac_backend if preconditioner is not None else 'none',
        threads=threads, median_step_ms=1000 * statistics.median(measured) if measured else None,
        mean_step_ms=1000 * statistics.fmean(measured) if measured else None,
        wall_s=time.time() - started,
    )
    if phase_sums and step_times:
        summary['kfac_phase_mean_ms'] = {k: 1000 * v / len(step_times) for k, v in sorted(phase_sums.items())}
    log(args, f'\nTraining time: {datetime.timedelta(seconds=round(time.time() - started))}')
    log(args, 'final: ' + json.dumps(summary, sort_keys=True))
    # Teardown order matters with torch 1.13: the DDP Reducer must not be the last owner of the Gloo process
    # group, or its destructor joins Gloo's worker threads while holding the GIL, and a worker that is
    # releasing a finished collective's Python tensor waits for the GIL forever (a hang at exit, seen in
    # about 1 of 4 two-worker runs). Drop the model, optimizer and preconditioner first; then the group.
    del model, optimizer, lr_scheduler, preconditioner, kfac_scheduler
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return summary


if __name__ == '__main__':
    main()
