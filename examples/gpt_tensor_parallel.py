"""A small GPT trained on the Python standard library's sources with FSDP2 x tensor parallel and dkfac, composed as
torchtitan composes them: one (dp, tp) DeviceMesh; `parallelize_module` splits the token embedding by its vocabulary
(RowwiseParallel), attention's query, key and value and the MLP's first layer by output features (ColwiseParallel),
their output projections by input features (RowwiseParallel), the head by output features, with sequence
parallelism between them (SequenceParallel norms, activations sharded on the sequence dimension); `fully_shard`
shards every block and the model over dp. K-FAC preconditions each rank's slices (docs/PYTHON.md "Tensor
parallel"), AdamW steps.

    torchrun --standalone --nproc-per-node 4 examples/gpt_tensor_parallel.py --tp 2          # dp 2 x tp 2
    torchrun --standalone --nproc-per-node 2 examples/gpt_tensor_parallel.py --tp 2 --no-kfac

Byte-level tokens (vocabulary 256); the corpus is every ``*.py`` under ``sysconfig.get_paths()['stdlib']``, in path
order, each rank reading its own windows. Prints the training loss every ``--log-interval`` steps and, at the end,
the validation loss and the K-FAC state this rank holds. Runs on CPUs over Gloo, or on GPUs over NCCL
(``--device cuda``, one GPU per rank).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

try:
    import dkfac
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / 'build' / 'python'))
    import dkfac


class Attention(torch.nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv = (torch.nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds heads / tp of them
        q, k, v = (w(x).view(batch, length, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, length, -1))


class Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attention_norm = torch.nn.LayerNorm(dim)
        self.attention = Attention(dim, heads)
        self.ffn_norm = torch.nn.LayerNorm(dim)
        self.w1 = torch.nn.Linear(dim, 4 * dim)
        self.w2 = torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.w2(F.gelu(self.w1(self.ffn_norm(x))))


class GPT(torch.nn.Module):
    """A token embedding, pre-norm blocks, a final norm and the head; no position embedding (causal attention alone
    tells the positions apart)."""

    def __init__(self, dim: int, heads: int, layers: int, vocab: int = 256) -> None:
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(dim)
        self.output = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def tensor_parallel(model: GPT, mesh) -> None:
    """torchtitan's plan: the token embedding split by its vocabulary, whose slices dkfac preconditions exactly as
    the whole layer (docs/MATH.md section 9.1), the blocks' projections as block-diagonal slices."""
    parallelize_module(model, mesh, {
        'tok_embeddings': RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        'norm': SequenceParallel(),
        'output': ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in model.layers:
        parallelize_module(block, mesh, {
            'attention_norm': SequenceParallel(),
            'attention': PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            'attention.wq': ColwiseParallel(), 'attention.wk': ColwiseParallel(), 'attention.wv': ColwiseParallel(),
            'attention.wo': RowwiseParallel(output_layouts=Shard(1)),
            'ffn_norm': SequenceParallel(),
            'w1': ColwiseParallel(input_layouts=Shard(1)),
            'w2': RowwiseParallel(output_layouts=Shard(1)),
        })


def corpus(max_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The standard library's sources as bytes: every tenth file held out for validation."""
    root = Path(sysconfig.get_paths()['stdlib'])
    train, val, total = [], [], 0
    for index, path in enumerate(sorted(p for p in root.rglob('*.py') if 'test' not in p.parts)):
        data = path.read_bytes()
        total += len(data)
        if total > max_bytes:
            break
        (val if index % 10 == 9 else train).append(data)
    as_tensor = lambda parts: torch.frombuffer(bytearray(b'\0'.join(parts)), dtype=torch.uint8).long()
    return as_tensor(train), as_tensor(val)


def windows(tokens: torch.Tensor, count: int, length: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(tokens.numel() - length - 1, (count,), generator=generator)
    return torch.stack([tokens[s:s + length + 1] for s in starts.tolist()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument('--tp', type=int, default=2, help='tensor-parallel ranks (dp = world size / tp)')
    parser.add_argument('--steps', type=int, default=200)
    parser.add_argument('--batch-size', type=int, default=8, help='sequences per data-parallel rank')
    parser.add_argument('--length', type=int, default=64, help='tokens per sequence (divisible by tp)')
    parser.add_argument('--dim', type=int, default=64)
    parser.add_argument('--heads', type=int, default=4, help='attention heads (divisible by tp)')
    parser.add_argument('--layers', type=int, default=2)
    parser.add_argument('--lr', type=float, default=3e-3)
    parser.add_argument('--no-kfac', action='store_true', help='AdamW alone')
    parser.add_argument('--factor-update-steps', type=int, default=5)
    parser.add_argument('--inv-update-steps', type=int, default=25)
    parser.add_argument('--damping', type=float, default=0.003)
    parser.add_argument('--tensor-parallel-factors', default='block_diagonal', choices=('block_diagonal', 'exact'))
    parser.add_argument('--corpus-bytes', type=int, default=4_000_000)
    parser.add_argument('--log-interval', type=int, default=10)
    parser.add_argument('--device', default='cpu', choices=('cpu', 'cuda'))
    parser.add_argument('--seed', type=int, default=0)
    args = parser.parse_args()

    dist.init_process_group('nccl' if args.device == 'cuda' else 'gloo')
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % args.tp:
        raise SystemExit(f'--tp {args.tp} does not divide the world size {world}')
    if args.device == 'cuda':
        torch.cuda.set_device(int(os.environ.get('LOCAL_RANK', 0)))
    mesh = init_device_mesh(args.device, (world // args.tp, args.tp), mesh_dim_names=('dp', 'tp'))
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == 'cuda' else torch.device('cpu')

    torch.manual_seed(args.seed)  # the same initial model on every rank
    model = GPT(args.dim, args.heads, args.layers).to(device)
    tensor_parallel(model, mesh['tp'])
    for block in model.layers:
        fully_shard(block, mesh=mesh['dp'])
    fully_shard(model, mesh=mesh['dp'])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    preconditioner = None
    if not args.no_kfac:
        preconditioner = dkfac.KFACPreconditioner(
            model, process_group=mesh['dp'].get_group(), factor_update_steps=args.factor_update_steps,
            inv_update_steps=args.inv_update_steps, damping=args.damping, lr=args.lr, kl_clip=None,
            tensor_parallel_factors=args.tensor_parallel_factors)

    train, val = corpus(args.corpus_bytes)
    generator = torch.Generator().manual_seed(1000 + mesh.get_local_rank('dp'))  # a data stream per replica

    def loss_of(batch: torch.Tensor) -> torch.Tensor:
        tokens, targets = batch[:, :-1].to(device), batch[:, 1:].to(device)
        # Every tensor-parallel rank feeds the whole sequence; the embedding hands on its chunk of it (sequence
        # parallel), and every rank gets the whole sequence's logits (the head's output is replicated).
        logits = model(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    start = time.perf_counter()
    for step in range(args.steps):
        loss = loss_of(windows(train, args.batch_size, args.length, generator))
        optimizer.zero_grad()
        loss.backward()
        if preconditioner is not None:
            preconditioner.step()
        optimizer.step()
        if rank == 0 and (step % args.log_interval == 0 or step == args.steps - 1):
            print(f'step {step:5d}  train loss {loss.item():.4f}  {time.perf_counter() - start:.1f} s', flush=True)
    model.eval()
    with torch.no_grad():
        held_out = torch.stack([loss_of(windows(val, args.batch_size, args.length, torch.Generator().manual_seed(i)))
                                for i in range(4)]).mean()
    if rank == 0:
        print(f'validation loss {held_out.item():.4f} ({math.exp(held_out.item()):.2f} perplexity per byte)')
        if preconditioner is not None:
            print(f"K-FAC state on rank 0: {preconditioner.memory_usage()['total'] / 2**20:.2f} MiB, "
                  f'{len(preconditioner.layers)} layers')
    dist.barrier()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
