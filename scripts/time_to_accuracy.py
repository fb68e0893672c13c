#!/usr/bin/env python3
"""Time to a target test accuracy on Fashion-MNIST (cnn, one process): several SGD tunings against K-FAC.

Runs `dkfac train` once per configuration (sequentially: the machine's cores are shared by nothing else),
reads each metrics file's per-epoch test accuracy and cumulative wall time, and prints a Markdown table with
the wall time at the end of the first epoch whose test accuracy reaches the target. Writes the metrics files
and curves.png (dkfac plot) to --out.

  ./scripts/time_to_accuracy.py --dkfac build/dkfac --out docs/perf/tta
"""
import argparse
import json
import os
import subprocess
import sys

SGD = ["--no-kfac", "--optimizer", "sgd", "--momentum", "0.9", "--weight-decay", "5e-4", "--lr-schedule", "cosine"]
RUNS = [
    # name, arguments (batch 128 unless given)
    ("sgd-lr0.05-e3", SGD + ["--lr", "0.05", "--epochs", "3"]),
    ("sgd-lr0.05-e4", SGD + ["--lr", "0.05", "--epochs", "4"]),
    ("sgd-lr0.05-e6", SGD + ["--lr", "0.05", "--epochs", "6"]),
    ("sgd-lr0.05-e10", SGD + ["--lr", "0.05", "--epochs", "10"]),
    ("sgd-lr0.1-e6", SGD + ["--lr", "0.1", "--epochs", "6"]),
    ("sgd-lr0.02-e6", SGD + ["--lr", "0.02", "--epochs", "6"]),
    ("sgd-b256-lr0.1-e8", SGD + ["--lr", "0.1", "--epochs", "8", "--batch-size", "256"]),
    ("kfac-inverse-e2", ["--epochs", "2"]),
    ("kfac-inverse-lr0.1-e2", ["--epochs", "2", "--lr", "0.1"]),
    ("kfac-inverse-e3", ["--epochs", "3"]),
    ("kfac-inverse-e4", ["--epochs", "4"]),
    ("kfac-eigen-e3", ["--epochs", "3", "--compute-method", "eigen"]),
]


def epochs_of(path):
    return [e for e in map(json.loads, open(path)) if e.get("event") == "epoch"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dkfac", default="build/dkfac")
    parser.add_argument("--out", default="docs/perf/tta")
    parser.add_argument("--target", type=float, default=0.91)
    parser.add_argument("--only", nargs="*", help="run only these configurations")
    parser.add_argument("--reuse", action="store_true", help="keep finished runs' metrics instead of rerunning them")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for name, extra in RUNS:
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
    print(f"| run | arguments | test accuracy per epoch (%) | wall time | time to {100 * args.target:.0f}% |")
    print("|---|---|---|---|---|")
    for name, extra, epochs, hit in rows:
        accs = " / ".join(f"{100 * e['test_accuracy']:.2f}" for e in epochs)
        reached = f"{hit['wall_time_s']:.1f} s (epoch {hit['epoch']})" if hit else "not reached"
        print(f"| {name} | `{extra}` | {accs} | {epochs[-1]['wall_time_s']:.1f} s | {reached} |")
    sgd = [h["wall_time_s"] for n, _, _, h in rows if n.startswith("sgd") and h]
    kfac = [h["wall_time_s"] for n, _, _, h in rows if n.startswith("kfac") and h]
    if sgd and kfac:
        print(f"\nfastest K-FAC / fastest SGD to {100 * args.target:.0f}%: {min(kfac):.1f} s / {min(sgd):.1f} s"
              f" = {min(kfac) / min(sgd):.2f}x")
    files = [os.path.join(args.out, n + ".jsonl") for n, _, _, _ in rows]
    subprocess.run([args.dkfac, "plot", "-o", os.path.join(args.out, "curves.png")] + files, check=True)


if __name__ == "__main__":
    main()
