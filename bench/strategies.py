#!/usr/bin/env python3
"""Strategy benchmark: every distributed K-FAC strategy with N local processes on the reference models.

For each model and strategy it runs `dkfac train --nproc N` for a fixed number of steps (factors and
second-order state updated every step by default, so every step is a second-order update), several
times, and prints per strategy and per rank: K-FAC phase times per step (factor construction,
decomposition, preconditioning), bytes per phase per step, K-FAC memory, and the median step time over
the repeats. Then the ratios the issue targets: DP-KFAC vs D-KFAC and SPD-KFAC vs D-KFAC.

    python3 bench/strategies.py                        # cnn and resnet20, 2 processes x batch 64, 3 repeats
    python3 bench/strategies.py --nproc 4 --batch-size 32   # 4 processes on the same global batch
    python3 bench/strategies.py --models cnn --repeats 1 --json runs/strategies.json

With --auto it checks `strategy auto` against reality instead (docs/STRATEGIES.md, "Choosing automatically"):
for each --nproc in the list it measures this machine's rates (`dkfac plan --measure-rates`), asks
`dkfac plan --strategy auto --json` for every candidate's predicted K-FAC time, runs every candidate and
plain SGD (`--no-kfac`, the forward/backward/optimizer time every strategy shares) with `dkfac train`, and
prints predicted vs measured step time per candidate and auto's pick against the measured best.

    python3 bench/strategies.py --auto --nproc-list 2,4 --global-batch 128 --steps 12 --warmup 3 --repeats 3
"""
import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile

# The D-KFAC baseline is as strong as the reference's defaults: KAISA comm-opt (f = 1) with the factor
# allreduces started from the capture hooks in 25 MB buckets (dkfac's default, kfac_pytorch's
# update_factors_in_hook / allreduce_bucket_cap_mb) and upper triangles (--symmetric-comm).
STRATEGIES = [
    ("dkfac", ["--strategy", "dkfac", "--symmetric-comm"]),  # D-KFAC = KAISA comm-opt (f = 1)
    ("kaisa-hybrid", ["--strategy", "kaisa", "--grad-worker-fraction", "0.5", "--symmetric-comm"]),
    ("dkfac-lw", ["--strategy", "dkfac-lw", "--symmetric-comm"]),  # KAISA mem-opt (f = 1/P)
    ("spd", ["--strategy", "spd"]),
    ("dp", ["--strategy", "dp"]),
]
KFAC_PHASES = ["factors", "second_order", "gradients"]


def run_once(binary, model, strategy_args, args, metrics):
    cmd = [binary, "train", "--nproc", str(args.nproc), "--model", model, "--batch-size", str(args.batch_size),
           "--max-steps", str(args.steps), "--log-every", "1", "--eval-examples", "1000",
           "--factor-update-steps", str(args.factor_steps), "--inv-update-steps", str(args.inv_steps),
           "--compute-method", args.compute_method, "--metrics", metrics] + strategy_args
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        sys.exit("benchmark run failed: " + " ".join(cmd) + "\n" + done.stdout[-3000:])
    events = [json.loads(line) for line in open(metrics)]
    steps = [e for e in events if e["event"] == "step"]
    summary = [e for e in events if e["event"] == "summary"][-1]
    # Step time: median of rank 0's step-to-step wall time, skipping the first warm-up steps.
    walls = [e["wall_time_s"] for e in steps]
    deltas = [b - a for a, b in zip(walls, walls[1:])][args.warmup:]
    return statistics.median(deltas), summary


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--binary", default="./build/dkfac")
    parser.add_argument("--models", default="cnn,resnet20")
    parser.add_argument("--strategies", default=",".join(name for name, _ in STRATEGIES))
    parser.add_argument("--nproc", type=int, default=2, help="local processes (2: one per core here)")
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="first step intervals left out of the step time")
    parser.add_argument("--factor-steps", type=int, default=1)
    parser.add_argument("--inv-steps", type=int, default=1)
    parser.add_argument("--compute-method", default="inverse")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--auto", action="store_true", help="check strategy auto's predictions and pick (see above)")
    parser.add_argument("--nproc-list", default="2,4", help="--auto: process counts")
    parser.add_argument("--global-batch", type=int, default=128, help="--auto: batch per rank = this / nproc")
    parser.add_argument("--recheck-steps", type=int, default=5,
                        help="--auto: steps strategy auto's re-check profiles (--auto-recheck-steps)")
    args = parser.parse_args()
    if args.auto:
        return auto_main(args)

    version = subprocess.run([args.binary, "--version"], stdout=subprocess.PIPE, text=True).stdout.strip()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"# {version}; {platform.platform()}; {cpu}; {os.cpu_count()} cores")
    threads = max(1, (os.cpu_count() or 1) // args.nproc)
    print(f"# {args.nproc} local processes x batch {args.batch_size}, {threads} LibTorch thread(s) each, Gloo on loopback; "
          f"factors every {args.factor_steps}, second order every {args.inv_steps} steps, {args.compute_method}; "
          f"{args.steps} steps, median step time over {args.repeats} runs (first {args.warmup} intervals skipped); "
          f"phase times and bytes are per step, averaged over the run; "
          f"comm ms = waiting for K-FAC collectives (not in the other phases); D-KFAC and KAISA: factors reduced "
          f"from the capture hooks in 25 MB buckets, upper triangles (--symmetric-comm)")
    wanted = args.strategies.split(",")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            results[model] = {}
            for name, strategy_args in STRATEGIES:
                if name not in wanted:
                    continue
                times, summaries = [], []
                for r in range(args.repeats):
                    t, s = run_once(args.binary, model, strategy_args, args, os.path.join(tmp, f"{model}-{name}-{r}.jsonl"))
                    times.append(t)
                    summaries.append(s)
                median_run = sorted(range(len(times)), key=times.__getitem__)[(len(times) - 1) // 2]
                results[model][name] = {"step_time_s": times[median_run], "step_times_s": times,
                                        "summary": summaries[median_run]}
            print_model(model, results[model], args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"version": version, "cpu": cpu, "args": vars(args), "results": results}, f, indent=2)


def candidate_args(c):
    """dkfac train flags for one candidate of `dkfac plan --strategy auto --json`."""
    if c["strategy"] == "kaisa":
        return ["--strategy", "kaisa", "--grad-worker-fraction", repr(c["grad_worker_fraction"])] + (
            ["--symmetric-comm"] if c["symmetric_comm"] else [])
    return ["--strategy", c["strategy"]]


def measured_step(binary, model, extra, args, metrics):
    """Median step time over the repeats, every run's time, and the median run's K-FAC phases (ms per step,
    max over ranks: factor, decomp, precond, comm) as the trainer measured them."""
    runs = [run_once(binary, model, extra, args, metrics + f"-{r}.jsonl") for r in range(args.repeats)]
    times = [t for t, _ in runs]
    median_run = sorted(range(len(times)), key=times.__getitem__)[(len(times) - 1) // 2]
    phases = {}
    if runs[median_run][1].get("ranks") and "--no-kfac" not in extra:
        rows = per_rank({"summary": runs[median_run][1]})
        for key in ["factors_ms", "second_order_ms", "precondition_ms", "comm_ms"]:
            phases[key] = max(r[key] for r in rows)
    return times[median_run], times, phases


def auto_main(args):
    version = subprocess.run([args.binary, "--version"], stdout=subprocess.PIPE, text=True).stdout.strip()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"# {version}; {platform.platform()}; {cpu}; {os.cpu_count()} cores; load average at start "
          f"{os.getloadavg()[0]:.2f}")
    print(f"# strategy auto against reality: global batch {args.global_batch}, factors every {args.factor_steps}, "
          f"second order every {args.inv_steps} steps, {args.compute_method}; {args.steps} steps per run, step time = "
          f"median of rank 0's step-to-step times (first {args.warmup} intervals skipped), median of {args.repeats} "
          f"runs; predicted step = measured --no-kfac step + predicted K-FAC time")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in [int(n) for n in args.nproc_list.split(",")]:
            args.nproc = nproc
            args.batch_size = args.global_batch // nproc
            threads = max(1, (os.cpu_count() or 1) // nproc)
            rates = os.path.join(tmp, f"rates-{nproc}.json")
            subprocess.run([args.binary, "plan", "--measure-rates", rates, "--nproc", str(nproc),
                            "--compute-method", args.compute_method], check=True, stdout=subprocess.DEVNULL)
            rates_json = json.load(open(rates))
            for model in args.models.split(","):
                plan = auto_plan(args, model, nproc, rates)
                base, base_runs, _ = measured_step(args.binary, model, ["--no-kfac"], args,
                                                os.path.join(tmp, f"{model}-{nproc}-sgd"))
                rows = []
                for c in plan["candidates"]:
                    m, runs, phases = measured_step(args.binary, model, candidate_args(c), args,
                                            os.path.join(tmp, f"{model}-{nproc}-{len(rows)}"))
                    rows.append({"name": c["name"], "predicted_kfac_s": c["step_seconds"],
                                 "predicted_step_s": base + c["step_seconds"], "measured_step_s": m,
                                 "measured_runs_s": runs, "memory_bytes": c["memory_bytes"],
                                 "phases_s": c["max_over_ranks_seconds"], "measured_phases_ms": phases})
                scales, rechecked = recheck(args, model, nproc, rates, os.path.join(tmp, f"{model}-{nproc}-auto"))
                for row, c in zip(rows, rechecked["candidates"]):
                    row["rechecked_step_s"] = base + c["step_seconds"]
                results[f"{model}-{nproc}"] = {"rates": rates_json, "sgd_step_s": base, "sgd_runs_s": base_runs,
                                               "chosen": plan["chosen"], "reason": plan["reason"], "candidates": rows,
                                               "recheck_scales": scales, "rechecked_chosen": rechecked["chosen"],
                                               "recheck_steps": args.recheck_steps}
                print_auto(model, nproc, args.batch_size, threads, results[f"{model}-{nproc}"])
    print(f"# load average at end {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"version": version, "cpu": cpu, "args": vars(args), "results": results}, f, indent=2)


def auto_plan(args, model, nproc, rates, extra=()):
    """`dkfac plan --strategy auto --json` for this model and process count on `rates`."""
    return json.loads(subprocess.run(
        [args.binary, "plan", "--strategy", "auto", "--rates", rates, "--model", model, "--nproc", str(nproc),
         "--batch-size", str(args.batch_size), "--compute-method", args.compute_method,
         "--factor-update-steps", str(args.factor_steps), "--inv-update-steps", str(args.inv_steps), "--json",
         *extra], check=True, stdout=subprocess.PIPE, text=True).stdout)


def recheck(args, model, nproc, rates, metrics):
    """Strategy auto's re-check as a job makes it: `dkfac train --strategy auto` on `rates` profiles
    --recheck-steps steps of its pick and prints measured / predicted per group of rates; the candidates are
    then predicted again with the rates scaled so (`dkfac plan --rate-scales`, the same scaling)."""
    cmd = [args.binary, "train", "--nproc", str(nproc), "--model", model, "--batch-size", str(args.batch_size),
           "--max-steps", str(args.recheck_steps + 1), "--eval-examples", "1000",
           "--factor-update-steps", str(args.factor_steps), "--inv-update-steps", str(args.inv_steps),
           "--compute-method", args.compute_method, "--metrics", metrics + ".jsonl", "--strategy", "auto",
           "--kfac-rates", rates, "--auto-recheck-steps", str(args.recheck_steps)]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    found = re.search(r"measured / predicted factors x(\S+), second order x(\S+), preconditioning x(\S+), "
                      r"communication x([^\s;]+)", done.stdout)
    if done.returncode != 0 or not found:
        sys.exit("strategy auto's re-check run failed: " + " ".join(cmd) + "\n" + done.stdout[-3000:])
    scales = [float(x) for x in found.groups()]
    return scales, auto_plan(args, model, nproc, rates, ["--rate-scales", ",".join(repr(x) for x in scales)])


def print_auto(model, nproc, batch, threads, res):
    print(f"\n## {model}, {nproc} processes x batch {batch}, {threads} LibTorch thread(s) each; --no-kfac step "
          f"{1e3 * res['sgd_step_s']:.1f} ms")
    print(f"{'candidate':<30}{'pred K-FAC':>11}{'pred step':>11}{'measured':>10}{'error':>8}{'re-checked':>12}"
          f"{'error':>8}   phases predicted / measured, max over ranks: factor, decomp, precond, comm (ms per step)")
    for r in res["candidates"]:
        err = 100 * (r["predicted_step_s"] / r["measured_step_s"] - 1)
        rerr = 100 * (r["rechecked_step_s"] / r["measured_step_s"] - 1)
        mark = "*" if r["name"] == res["chosen"] else " "
        p, m = r["phases_s"], r["measured_phases_ms"]
        comm = 1e3 * (p["factor_comm"] + p["second_order_comm"] + p["gradient_comm"])
        phases = (f"{1e3 * p['factor_build']:.0f}/{m.get('factors_ms', 0):.0f}  {1e3 * p['decomposition']:.0f}/"
                  f"{m.get('second_order_ms', 0):.0f}  {1e3 * p['precondition']:.0f}/{m.get('precondition_ms', 0):.0f}  "
                  f"{comm:.0f}/{m.get('comm_ms', 0):.0f}")
        print(f"{mark}{r['name']:<29}{1e3 * r['predicted_kfac_s']:>11.1f}{1e3 * r['predicted_step_s']:>11.1f}"
              f"{1e3 * r['measured_step_s']:>10.1f}{err:>+7.1f}%{1e3 * r['rechecked_step_s']:>12.1f}{rerr:>+7.1f}%   "
              f"{phases}")
    best = min(res["candidates"], key=lambda r: r["measured_step_s"])
    pick = next(r for r in res["candidates"] if r["name"] == res["chosen"])
    worst_err = max(abs(r["predicted_step_s"] / r["measured_step_s"] - 1) for r in res["candidates"])
    print(f"auto picked {pick['name']} (measured {1e3 * pick['measured_step_s']:.1f} ms); measured best {best['name']} "
          f"({1e3 * best['measured_step_s']:.1f} ms): pick {100 * (pick['measured_step_s'] / best['measured_step_s'] - 1):.1f}% "
          f"slower than the best (goal <= 5%); largest prediction error {100 * worst_err:.1f}% (goal <= 20%)")
    re_pick = next(r for r in res["candidates"] if r["name"] == res["rechecked_chosen"])
    re_err = max(abs(r["rechecked_step_s"] / r["measured_step_s"] - 1) for r in res["candidates"])
    s = res["recheck_scales"]
    print(f"re-check (a --strategy auto job's {res['recheck_steps']} profiled steps of its pick): measured / "
          f"predicted factors x{s[0]:.3g}, second order x{s[1]:.3g}, preconditioning x{s[2]:.3g}, communication "
          f"x{s[3]:.3g}; with the rates scaled so: pick {re_pick['name']} "
          f"({100 * (re_pick['measured_step_s'] / best['measured_step_s'] - 1):.1f}% slower than the best), largest "
          f"prediction error {100 * re_err:.1f}%")
    sys.stdout.flush()


def per_rank(entry):
    s = entry["summary"]
    steps = s["steps"]
    rows = []
    for r in s["ranks"]:
        t = r["kfac_time_s"]
        rows.append({"rank": r["rank"], "factors_ms": 1e3 * t["factors"] / steps,
                     "second_order_ms": 1e3 * t["second_order"] / steps,
                     "precondition_ms": 1e3 * t["precondition"] / steps,
                     "comm_ms": 1e3 * t["communication"] / steps,
                     "bytes": {k: r["comm_bytes"].get(k, 0) // steps for k in ["data_parallel"] + KFAC_PHASES},
                     "kfac_bytes": sum(r["comm_bytes"].get(k, 0) for k in KFAC_PHASES) / steps,
                     "memory": r["kfac_memory_bytes"]})
    return rows


def print_model(model, res, args):
    print(f"\n## {model}")
    print(f"{'strategy':<13}{'rank':>5}{'factor ms':>11}{'decomp ms':>11}{'precond ms':>12}"
          f"{'comm ms':>9}{'DP B':>11}{'factor B':>11}{'2nd-ord B':>11}{'V B':>10}{'memory B':>11}{'step ms':>10}")
    for name, entry in res.items():
        for row in per_rank(entry):
            b = row["bytes"]
            print(f"{name:<13}{row['rank']:>5}{row['factors_ms']:>11.1f}{row['second_order_ms']:>11.1f}"
                  f"{row['precondition_ms']:>12.1f}{row['comm_ms']:>9.1f}{b['data_parallel']:>11}{b['factors']:>11}{b['second_order']:>11}"
                  f"{b['gradients']:>10}{row['memory']:>11}{1e3 * entry['step_time_s']:>10.1f}")
    if "dkfac" in res and "dp" in res:
        d, p = per_rank(res["dkfac"]), per_rank(res["dp"])
        mx = lambda rows, k: max(r[k] for r in rows)
        print(f"DP-KFAC vs D-KFAC (max over ranks, per step): factor construction "
              f"{mx(d, 'factors_ms') / max(mx(p, 'factors_ms'), 1e-9):.2f}x lower, K-FAC communication "
              f"{mx(d, 'kfac_bytes') / max(mx(p, 'kfac_bytes'), 1):.2f}x lower, K-FAC memory "
              f"{mx(d, 'memory') / max(mx(p, 'memory'), 1):.2f}x lower")
    if "dkfac" in res and "spd" in res:
        d, s = res["dkfac"]["step_time_s"], res["spd"]["step_time_s"]
        change = f"{100 * (1 - s / d):.1f}% faster" if s <= d else f"{100 * (s / d - 1):.1f}% slower"
        print(f"SPD-KFAC vs D-KFAC step time: {1e3 * s:.1f} ms vs {1e3 * d:.1f} ms ({change})")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
