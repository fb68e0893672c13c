#!/usr/bin/env python3
"""Tables of docs/PLANS.md from `dkfac plan --json` (python3 standard library only).

1. DP-KFAC against D-KFAC per K-FAC update at 64 ranks for each paper-scale model, next to the ranges the
   DP-KFAC paper (2022) reports at 64 GPUs.
2. KAISA's memory against communication across grad-worker fractions for ResNet-50 at 64 ranks.

Every figure is a JSON field of the `dkfac plan` command printed above its table, or a ratio of two.

    python3 scripts/plan_ratios.py [--dkfac build/dkfac] [--nproc 64] [--batch-size 32]
"""
import argparse
import json
import subprocess

MODELS = [("resnet50", "imagenet"), ("resnet152", "imagenet"), ("densenet201", "imagenet"),
          ("inception-v4", "imagenet"), ("bert-large", "wikipedia")]
PAPER = {"computation": "1.55-1.65x", "communication": "2.79-3.15x", "memory": "1.14-1.47x"}


def plan(dkfac, args):
    command = [dkfac, "plan"] + args + ["--json"]
    print("    $ ./build/dkfac plan " + " ".join(args) + " --json")
    return json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)


def strategy(report, name):
    """The row `name` of a plan ("dp", "kaisa f=1/2 (W=32)"; a KAISA row may end in " triangles")."""
    for s in report["strategies"]:
        if s["strategy"] == name or s["strategy"].startswith(name + " "):
            return s
    raise KeyError(name)


def kaisa(report, grad_workers):
    """KAISA's row with W = `grad_workers`: W = P is SC20's D-KFAC (comm-opt), W = 1 its layer-wise variant."""
    p = report["nproc"]
    f = "1" if grad_workers == p else f"1/{p // grad_workers}"
    return strategy(report, f"kaisa f={f} (W={grad_workers})")


def mib(b):
    return f"{b / 2**20:,.1f}"


def gflop(f):
    return f"{f / 1e9:,.1f}"


def decomposition_weight(report, target):
    """Per-FLOP cost k of a decomposition relative to the other K-FAC work at which the max-rank update cost
    (factor + precondition + k x decomposition FLOPs) of D-KFAC over DP-KFAC equals `target` (bisection)."""
    def cost(row, k):
        return max(r["factor_flops"] + r["precondition_flops"] + k * r["decomposition_flops"]
                   for r in row["ranks"])
    lo, hi = 1.0, 1e6
    d_kfac, dp = kaisa(report, report["nproc"]), strategy(report, "dp")
    if cost(d_kfac, hi) / cost(dp, hi) > target or cost(d_kfac, lo) / cost(dp, lo) < target:
        return None
    for _ in range(200):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if cost(d_kfac, mid) / cost(dp, mid) > target else (lo, mid)
    return lo


def ratios(dkfac, nproc, batch, triangles):
    flags = ["--symmetric-comm"] if triangles else []
    layout = "upper triangles" if triangles else "full matrices"
    print(f"\n### DP-KFAC vs D-KFAC, {nproc} ranks x batch {batch}, inverse, float32, KAISA factors and "
          f"inverses as {layout}\n")
    rows, comm = [], []
    for model, dataset in MODELS:
        r = plan(dkfac, ["--model", model, "--dataset", dataset, "--nproc", str(nproc), "--batch-size", str(batch),
                         "--compute-method", "inverse", "--spd-redundant-dim", "100000"] + flags)
        d, p = kaisa(r, nproc)["summary"], strategy(r, "dp")["summary"]
        state = r["model_state_bytes"]
        dm, pm = d["memory_bytes"]["max"], p["memory_bytes"]["max"]
        other = [(dm - x * pm) / (x - 1) for x in (1.14, 1.47)]
        k = decomposition_weight(r, 1.60)
        rows.append([
            model, str(len(r["layers"])),
            f"{gflop(d['update_flops']['max'])} / {gflop(p['update_flops']['max'])} = "
            f"**{d['update_flops']['max'] / p['update_flops']['max']:.2f}x**",
            f"{d['factor_flops']['max'] / p['factor_flops']['max']:.2f}x",
            "n/a" if k is None else f"{k:.0f}",
            f"{mib(d['update_bytes']['max'])} / {mib(p['update_bytes']['max'])} = "
            f"**{d['update_bytes']['max'] / p['update_bytes']['max']:.2f}x**",
            f"{d['update_ring_bytes']['max'] / p['update_ring_bytes']['max']:.2f}x",
            f"{mib(dm)} / {mib(pm)} = **{dm / pm:.2f}x**",
            f"{(dm + state) / (pm + state):.2f}x",
            f"{other[1] / 2**30:.2f} / {other[0] / 2**30:.2f}",
        ])
        s, lw = strategy(r, "spd")["summary"], kaisa(r, 1)["summary"]
        comm.append([model, f"{mib(s['update_bytes']['max'])}",
                     f"**{s['update_bytes']['max'] / p['update_bytes']['max']:.2f}x**",
                     f"{s['update_ring_bytes']['max'] / p['update_ring_bytes']['max']:.2f}x",
                     f"{mib(lw['update_bytes']['max'])}",
                     f"{lw['update_bytes']['max'] / p['update_bytes']['max']:.2f}x",
                     f"{lw['update_ring_bytes']['max'] / p['update_ring_bytes']['max']:.2f}x"])
    print()
    print("| model | K-FAC layers | computation: update GFLOP, max rank, D-KFAC / DP-KFAC | factor construction "
          "only | decomposition cost per FLOP (x other K-FAC FLOPs) giving 1.60x | communication: K-FAC MiB per update, max rank (payload) | same, ring model "
          "| K-FAC memory MiB, max rank | memory + weights, gradients, momentum "
          "| other GiB per rank giving the paper's 1.47x / 1.14x |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"| DP-KFAC paper, 64 GPUs (range over its models) | | {PAPER['computation']} | | | "
          f"{PAPER['communication']} | | {PAPER['memory']} (GPU memory) | | |")
    print(f"\nCommunication against two other D-KFAC baselines from the same commands: factors only "
          f"(`spd` row with --spd-redundant-dim 100000: triangles allreduced, every inverse computed on every "
          f"rank, nothing second-order sent) and layer-wise (`kaisa f=1/P (W=1)` row: factors + V broadcast; its factors "
          f"as {layout}).\n")
    print("| model | factors only: MiB per update | vs DP-KFAC (payload) | ring model "
          "| layer-wise: MiB per update | vs DP-KFAC (payload) | ring model |")
    print("|---|---|---|---|---|---|---|")
    for row in comm:
        print("| " + " | ".join(row) + " |")


def kaisa_tradeoff(dkfac, nproc, batch):
    fractions = []
    k = nproc
    while k >= 1:
        fractions.append(k)
        k //= 2
    args = ["--model", "resnet50", "--dataset", "imagenet", "--nproc", str(nproc), "--batch-size", str(batch),
            "--compute-method", "inverse"]
    for k in fractions:
        args += ["--grad-worker-fraction", repr(1.0 / k)]
    print(f"\n### KAISA on ResNet-50, {nproc} ranks x batch {batch}, inverse, float32, full matrices\n")
    r = plan(dkfac, args)
    print()
    print("| f | W | K-FAC memory MiB (max rank) | K-FAC memory MiB (median rank) | 2nd-order MiB per inverse step (max) | V MiB per step (max) "
          "| K-FAC MiB per update (max rank) | precondition GFLOP per step (max) |")
    print("|---|---|---|---|---|---|---|---|")
    for k in fractions:
        s = kaisa(r, nproc // k)
        m = s["summary"]
        print(f"| {'1' if k == 1 else '1/' + str(k)} | {s['grad_workers']} | {mib(m['memory_bytes']['max'])} | "
              f"{mib(m['memory_bytes']['median'])} | {mib(m['second_order_bytes']['max'])} | {mib(m['gradient_bytes']['max'])} | "
              f"{mib(m['update_bytes']['max'])} | {gflop(m['precondition_flops']['max'])} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dkfac", default="build/dkfac")
    parser.add_argument("--nproc", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    ratios(args.dkfac, args.nproc, args.batch_size, triangles=True)
    ratios(args.dkfac, args.nproc, args.batch_size, triangles=False)
    kaisa_tradeoff(args.dkfac, args.nproc, args.batch_size)


if __name__ == "__main__":
    main()
