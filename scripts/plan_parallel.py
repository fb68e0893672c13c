#!/usr/bin/env python3
"""docs/STRATEGIES.md's table of K-FAC state and traffic per rank under tensor and pipeline parallelism, from
`dkfac plan --json` (python3 standard library only).

For GPT-style models by shape (gpt-1.3b, gpt-6.7b: tools/models/paper_shapes.h) at 64 and 512 ranks: per rank of
the fullest pipeline stage (its first tensor-parallel rank), K-FAC memory and bytes per update for KAISA at f = 1
(D-KFAC), at f = 1/dp (one grad worker per layer) and DP-KFAC, beside the rank's share of the weights.

    python3 scripts/plan_parallel.py [--dkfac build/dkfac]
"""
import argparse
import json
import subprocess

CASES = [("gpt-1.3b", 64, 1, 1), ("gpt-1.3b", 64, 2, 1), ("gpt-1.3b", 64, 2, 2), ("gpt-1.3b", 64, 4, 2),
         ("gpt-6.7b", 64, 1, 1), ("gpt-6.7b", 64, 8, 1), ("gpt-6.7b", 64, 8, 2), ("gpt-6.7b", 64, 4, 4),
         ("gpt-6.7b", 512, 8, 4), ("gpt-6.7b", 512, 8, 8)]


def row(report, name):
    for s in report["strategies"]:
        if s["strategy"] == name:
            return s
    raise KeyError(name)


def gib(b):
    return f"{b / 2**30:,.2f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dkfac", default="build/dkfac")
    args = parser.parse_args()
    commands = []
    lines = []
    for model, nproc, tp, pp in CASES:
        flags = ["--model", model, "--nproc", str(nproc), "--tp", str(tp), "--pp", str(pp), "--batch-size", "1",
                 "--compute-method", "eigen"]
        commands.append("./build/dkfac plan " + " ".join(flags) + " --json")
        report = json.loads(subprocess.run([args.dkfac, "plan"] + flags + ["--json"], check=True,
                                           capture_output=True, text=True).stdout)
        dp = report["dp"]
        f1 = row(report, f"kaisa f=1 (W={dp})")
        lw = row(report, f"kaisa f=1/{dp} (W=1)") if dp > 1 else f1
        dpk = row(report, "dp")
        weights = 4 * report["parameters"] / (tp * pp)
        cells = []
        for s in (f1, lw, dpk):
            m = s["summary"]
            cells.append(f"{gib(m['memory_bytes']['max'])} / {gib(m['update_bytes']['max'])}")
        lines.append(f"| {model} | {nproc} | {tp} x {pp} x {dp} | {gib(weights)} | " + " | ".join(cells) + " |")
    print("\n".join("    $ " + c for c in commands))
    print()
    print("| model | ranks | tp x pp x dp | weights GiB per rank | KAISA f = 1: memory / update GiB "
          "| KAISA W = 1 | DP-KFAC |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
