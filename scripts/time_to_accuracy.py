#!/usr/bin/env python3
"""Time to a target test accuracy on Fashion-MNIST (cnn): several SGD tunings against K-FAC.

Two groups of runs: one process ("1p": SGD tunings against K-FAC recipes), and four local processes at the
same global batch ("4p": data-parallel SGD against each distributed K-FAC strategy). Runs `dkfac train` once
per configuration (sequentially: the machine's cores are shared by nothing else), reads each metrics file's
per-epoch test accuracy and cumulative wall time, and prints a Markdown table per group with the wall time at
the end of the first epoch whose test accuracy reaches the target, then the fastest K-FAC run against the
fastest SGD run of the group. Writes the metrics files and one curves PNG per group (dkfac plot) to --out.

  ./scripts/time_to_accuracy.py --dkfac build/dkfac --out docs/perf/tta
  ./scripts/time_to_accuracy.py --groups 4p --reuse
"""
import argparse
import json
import os
import subprocess
import sys

SGD = ["--no-kfac", "--optimizer", "sgd", "--momentum", "0.9", "--weight-decay", "5e-4", "--lr-schedule", "cosine"]
FOUR = ["--nproc", "4", "--batch-size", "32"]  # global batch 128, as the one-process runs
RUNS = [
    # group, name, arguments (batch 128 unless given; names starting "sgd" are the baselines)
    ("1p", "sgd-lr0.05-e3", SGD + ["--lr", "0.05", "--epochs", "3"]),
    ("1p", "sgd-lr0.05-e4", SGD + ["--lr", "0.05", "--epochs", "4"]),
    ("1p", "sgd-lr0.05-e6", SGD + ["--lr", "0.05", "--epochs", "6"]),
    ("1p", "sgd-lr0.05-e10", SGD + ["--lr", "0.05", "--epochs", "10"]),
    ("1p", "sgd-lr0.1-e6", SGD + ["--lr", "0.1", "--epochs", "6"]),
    ("1p", "sgd-lr0.02-e6", SGD + ["--lr", "0.02", "--epochs", "6"]),
    ("1p", "sgd-b256-lr0.1-e8", SGD + ["--lr", "0.1", "--epochs", "8", "--batch-size", "256"]),
    ("1p", "kfac-inverse-e2", ["--epochs", "2"]),
    ("1p", "kfac-inverse-d0.1-e2", ["--epochs", "2", "--damping", "0.1"]),
    ("1p", "kfac-inverse-lr0.1-e2", ["--epochs", "2", "--lr", "0.1"]),
    ("1p", "kfac-inverse-e3", ["--epochs", "3"]),
    ("1p", "kfac-inverse-e4", ["--epochs", "4"]),
    ("1p", "kfac-eigen-e3", ["--epochs", "3", "--compute-method", "eigen"]),
    ("1p", "kfac-skip-fc1-e3", ["--epochs", "3", "--skip-layers", "^7$"]),
    ("4p", "sgd-4p-lr0.05-e3", FOUR + SGD + ["--lr", "0.05", "--epochs", "3"]),
    ("4p", "sgd-4p-lr0.05-e4", FOUR + SGD + ["--lr", "0.05", "--epochs", "4"]),
    ("4p", "kfac-4p-dkfac-d0.1-e2", FOUR + ["--epochs", "2", "--damping", "0.1", "--strategy", "kaisa", "--grad-worker-fraction", "1"]),
    ("4p", "kfac-4p-spd-d0.1-e2", FOUR + ["--epochs", "2", "--damping", "0.1", "--strategy", "spd"]),
    ("4p", "kfac-4p-dp-d0.1-e2", FOUR + ["--epochs", "2", "--damping", "0.1", "--strategy", "dp"]),
]


def epochs_of(path):
    return [e for e in map(json.loads, open(path)) if e.get("event") == "epoch"]


def table(rows, target):
    print(f"| run | arguments | test accuracy per epoch (%) | wall time | time to {100 * target:.0f}% |")
    print("|---|---|---|---|---|")
    for name, extra, epochs, hit in rows:
        accs = " / ".join(f"{100 * e['test_accuracy']:.2f}" for e in epochs)
        reached = f"{hit['wall_time_s']:.1f} s (epoch {hit['epoch']})" if hit else "not reached"
        print(f"| {name} | `{extra}` | {accs} | {epochs[-1]['wall_time_s']:.1f} s | {reached} |")
    sgd = [(h["wall_time_s"], n) for n, _, _, h in rows if n.startswith("sgd") and h]
    kfac = [(h["wall_time_s"], n) for n, _, _, h in rows if n.startswith("kfac") and h]
    if sgd and kfac:
        (k, kname), (g, gname) = min(kfac), min(sgd)
        print(f"\nfastest K-FAC / fastest SGD to {100 * target:.0f}%: {kname} {k:.1f} s / {gname} {g:.1f} s"
              f" = {k / g:.2f}x")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dkfac", default="build/dkfac")
    parser.add_argument("--out", default="docs/perf/tta")
    parser.add_argument("--target", type=float, default=0.91)
    parser.add_argument("--groups", nargs="*", default=["1p", "4p"], help="groups of runs (1p, 4p)")
    parser.add_argument("--only", nargs="*", help="run only these configurations")
    parser.add_argument("--reuse", action="store_true", help="keep finished runs' metrics instead of rerunning them")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for group in args.groups:
        rows = []
        for name, extra in [(n, a) for g, n, a in RUNS if g == group]:
            if args.only and name not in args.only:
                continue
            metrics = os.path.join(args.out, name + ".jsonl")
            finished = os.path.exists(metrics) and '"event":"summary"' in open(metrics).read()
            if not (args.reuse and finished):
                if os.path.exists(metrics):
                    os.remove(metrics)
                cmd = [args.dkfac, "train", "--model", "cnn", "--metrics", metrics] + extra
                print("running:", " ".join(cmd), file=sys.stderr, flush=True)
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            epochs = epochs_of(metrics)
            hit = next((e for e in epochs if e["test_accuracy"] >= args.target), None)
            rows.append((name, " ".join(extra), epochs, hit))
        if not rows:
            continue
        print(f"\n### {group}\n")
        table(rows, args.target)
        files = [os.path.join(args.out, n + ".jsonl") for n, _, _, _ in rows]
        png = os.path.join(args.out, "curves.png" if group == "1p" else f"curves-{group}.png")
        subprocess.run([args.dkfac, "plot", "-o", png] + files, check=True)


if __name__ == "__main__":
    main()
