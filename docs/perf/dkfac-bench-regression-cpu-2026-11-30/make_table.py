"""Builds README.md's tables from the six JSON files here. Times in ms from the JSON's seconds, to 0.001 ms
(the base prints 3 significant digits in its .txt table, the new binary 4-5, so the JSON is the common source);
ratios new/base per pair from full precision; 'median' and 'range' are over the 3 pairs.
Usage: python3 make_table.py median|mean [phase ...]"""
import json, statistics, sys
from pathlib import Path

here = Path(__file__).parent
pairs = [("pair1-base-core0", "pair1-new-core1"), ("pair2-base-core1", "pair2-new-core0"),
         ("pair3-base-core0", "pair3-new-core1")]
stat = sys.argv[1] if len(sys.argv) > 1 else "median"
phases = sys.argv[2:] or ["step", "forward_backward", "factors", "second_order", "precondition", "apply",
                          "optimizer"]

def load(name):
    out = {}
    for r in json.loads((here / f"{name}.json").read_text())["steps"]:
        label = r["optimizer"] if r["optimizer"] == "sgd" else \
            f'kfac {r["method"]} ({r["factor_update_steps"]},{r["inv_update_steps"]})'
        out[(r["model"], label)] = {ph: v[f"{stat}_s"] for ph, v in r["phases"].items()}
    return out

runs = [(load(b), load(n)) for b, n in pairs]
keys = list(runs[0][0].keys())
assert all(list(b.keys()) == keys and list(n.keys()) == keys for b, n in runs)
print("| model | config | phase | " + " | ".join(f"p{k} base | p{k} new | p{k} new/base" for k in (1, 2, 3))
      + " | median new/base | range |")
print("|" + "---|" * 14)
for key in keys:
    for ph in phases:
        cells, ratios = [], []
        for b, n in runs:
            vb, vn = b[key][ph], n[key][ph]
            r = vn / vb if vb > 0 else None
            if r is not None:
                ratios.append(r)
            cells += [f"{vb * 1e3:.3f}", f"{vn * 1e3:.3f}", f"{r:.3f}" if r is not None else "n/a"]
        if not ratios and all(b[key][ph] == 0 and n[key][ph] == 0 for b, n in runs):
            continue  # not run at this statistic (SGD's K-FAC phases; the median of a phase run every 10th step)
        med = f"{statistics.median(ratios):.3f}" if len(ratios) == 3 else "n/a"
        rng = f"{min(ratios):.3f}-{max(ratios):.3f}" if len(ratios) == 3 else "n/a"
        print(f"| {key[0]} | {key[1]} | {ph} | " + " | ".join(cells) + f" | {med} | {rng} |")
