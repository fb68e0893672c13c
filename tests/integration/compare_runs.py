#!/usr/bin/env python3
"""Compares two `dkfac train --metrics` files: the per-step losses of RUN against REFERENCE (the last value
logged for a step wins, so a resumed run's re-done steps replace the lost ones) and, with
--same-parameters, the final parameters' CRC-32. Prints one line; exits 1 with "FAIL: ..." on a difference.

  compare_runs.py REFERENCE RUN [--steps N] [--rtol R] [--first-rtol R1] [--same-parameters]

Runs on different devices (CPU and GPU) round differently: --rtol then bounds the drift, and --first-rtol the
first logged step alone (the same weights and batch on both sides), tighter.
"""
import argparse
import json
import sys


def read(path):
    losses, summary = {}, None
    for event in map(json.loads, open(path)):
        if event.get("event") == "step":
            losses[event["step"]] = event["loss"]
        elif event.get("event") == "summary":
            summary = event
    return losses, summary


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reference")
    parser.add_argument("run")
    parser.add_argument("--steps", type=int, help="both files must log exactly the steps 1..N")
    parser.add_argument("--rtol", type=float, default=0.0, help="largest relative difference allowed (0: equal)")
    parser.add_argument("--first-rtol", type=float, help="largest relative difference at the first logged step")
    parser.add_argument("--same-parameters", action="store_true", help="the final parameters' CRC-32 must match")
    args = parser.parse_args()
    (reference, ref_summary), (run, run_summary) = read(args.reference), read(args.run)
    if args.steps is not None:
        expected = set(range(1, args.steps + 1))
        for name, losses in (("reference", reference), ("run", run)):
            if set(losses) != expected:
                missing, extra = sorted(expected - set(losses)), sorted(set(losses) - expected)
                sys.exit(f"FAIL: the {name} logs {len(losses)} steps, not 1..{args.steps} "
                         f"(missing {missing[:5]}, extra {extra[:5]})")
    missing = [s for s in reference if s not in run]
    if missing:
        sys.exit(f"FAIL: {len(missing)} steps of the reference are not in the run, first {missing[0]}")
    worst, first = 0.0, None
    for step in sorted(reference):
        diff = abs(run[step] - reference[step]) / max(abs(reference[step]), 1e-12)
        if diff > args.rtol and first is None:
            first = (step, reference[step], run[step])
        worst = max(worst, diff)
    if first:
        sys.exit(f"FAIL: losses differ, first at step {first[0]}: {first[1]} vs {first[2]} "
                 f"(largest relative difference {worst:.3g}, allowed {args.rtol:g})")
    line = f"{len(reference)} logged losses equal (largest relative difference {worst:.1g})"
    if args.first_rtol is not None and reference:
        step = min(reference)
        diff = abs(run[step] - reference[step]) / max(abs(reference[step]), 1e-12)
        if diff > args.first_rtol:
            sys.exit(f"FAIL: the first logged loss (step {step}) differs: {reference[step]} vs {run[step]} "
                     f"(relative {diff:.3g}, allowed {args.first_rtol:g})")
        line += f", step {step} within {diff:.1g}"
    if args.same_parameters:
        a, b = ref_summary["parameters_crc32"], run_summary["parameters_crc32"]
        if a != b:
            sys.exit(f"FAIL: final parameters differ (crc32 {a:08x} vs {b:08x})")
        line += f", final parameters equal (crc32 {a:08x})"
    if run_summary and "final_test_accuracy" in run_summary:
        line += f", final test accuracy {100 * run_summary['final_test_accuracy']:.2f}%"
    print(line)


if __name__ == "__main__":
    main()
