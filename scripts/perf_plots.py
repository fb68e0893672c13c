#!/usr/bin/env python3
"""Plots of `dkfac bench --json` results with gnuplot: where a step's time goes (stacked mean ms per
phase, per model and configuration) and the kernels' GFLOP/s against the measured sgemm peak.

  ./scripts/perf_plots.py docs/perf/bench.json docs/perf/kernels.json -o docs/perf
"""
import argparse
import json
import os
import subprocess
import tempfile

PHASES = ["forward_backward", "factors", "second_order", "precondition", "apply", "communication", "optimizer"]
# dkfac bench named the second-order phase "decomposition" before the phases became one list (dkfac/phase.h);
# the committed bench.json files keep that name.
EARLIER_NAMES = {"second_order": "decomposition"}


def phase(run: dict, name: str) -> dict:
    phases = run["phases"]
    return phases[name] if name in phases else phases[EARLIER_NAMES[name]]


def label(run):
    if run["optimizer"] != "kfac":
        return f"{run['model']} SGD"
    return f"{run['model']} {run['method'][:3]} ({run['factor_update_steps']},{run['inv_update_steps']})"


def gnuplot(script):
    subprocess.run(["gnuplot"], input=script, text=True, check=True)


def phases_plot(steps, out, tmp):
    models = list(dict.fromkeys(run["model"] for run in steps))
    panels = []
    for model in models:
        data = os.path.join(tmp, f"phases_{model}.dat")
        with open(data, "w") as f:
            for run in (r for r in steps if r["model"] == model):
                f.write(f'"{label(run)}" ' + " ".join(f"{1e3 * phase(run, p)['mean_s']:.3f}" for p in PHASES) + "\n")
        cols = ", ".join(f"'{data}' using {i + 2}:xtic(1) title '{p}'" for i, p in enumerate(PHASES))
        panels.append(f"set title '{model}'\nplot {cols}")
    body = "\n".join(panels)
    gnuplot(f"""set terminal pngcairo size 1500,700 noenhanced
set output '{out}'
set style data histograms
set style histogram rowstacked
set style fill solid 0.85 border -1
set boxwidth 0.75
set ylabel 'mean ms per step (amortised over inverse periods)'
set xtics rotate by -40
set key below font ',9' maxrows 3
set multiplot layout 1,{len(models)} title 'dkfac bench: time per step by phase, batch 128'
{body}
unset multiplot
""")


def kernels_plot(kernels, out, tmp):
    series = {}
    for k in kernels:
        name = k["kernel"] + (f" rows {k['rows']}" if k["kernel"] == "factor" else "")
        series.setdefault(name, []).append((k["dim"], k["gflops"]))
    plots = []
    for name, points in sorted(series.items()):
        path = os.path.join(tmp, name.replace(" ", "_") + ".dat")
        with open(path, "w") as f:
            for dim, gflops in sorted(points):
                f.write(f"{dim} {gflops:.3f}\n")
        plots.append(f"'{path}' using 1:2 with linespoints lw 2 title '{name}'")
    gnuplot(f"""set terminal pngcairo size 1000,600 noenhanced
set output '{out}'
set logscale x 2
set xlabel 'dimension'
set ylabel 'GFLOP/s (float32)'
set key top left
set grid
set title 'dkfac bench: kernels (factor = X^T X counted as a full GEMM)'
plot {", ".join(plots)}
""")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("steps_json", help="dkfac bench --json output with steps")
    parser.add_argument("kernels_json", help="dkfac bench --json output with kernels")
    parser.add_argument("-o", "--out", default="docs/perf")
    args = parser.parse_args()
    steps = json.load(open(args.steps_json))["steps"]
    kernels = json.load(open(args.kernels_json))["kernels"]
    with tempfile.TemporaryDirectory() as tmp:
        phases_plot(steps, os.path.join(args.out, "phases.png"), tmp)
        kernels_plot(kernels, os.path.join(args.out, "kernels.png"), tmp)
    print(f"wrote {args.out}/phases.png and {args.out}/kernels.png")


if __name__ == "__main__":
    main()
