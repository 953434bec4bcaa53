"""The embedded default's trade-off between the preference reward and prompt fidelity.

Collect rows from finished training runs (their summary.json, config.yaml and metrics.jsonl),
then plot them: JPEG compressibility gained against the shapes checks' `fidelity_score` change,
both on the same 256 held-out images before and after.

    python tools/tradeoff.py collect --label "window 6, jpeg" runs/a \
        --csv docs/results/data/default_tradeoff.csv
    python tools/tradeoff.py plot docs/results/data/default_tradeoff.csv \
        --out docs/images/default_tradeoff.png
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import yaml

FIELDS = ["label", "reward", "mix_advantage", "sde_window", "chunks", "fraction", "kl_ref",
          "kl_coef", "lr", "precision", "iterations", "trained_gain", "trained_gain_ci95",
          "jpeg_before", "jpeg_after", "fidelity_before", "fidelity_after",
          "fidelity_gain_ci95", "verdict"]
PREFERENCE = "jpeg_compressibility"
FIDELITY_FLOOR = -0.02  # the default must keep fidelity_score within this of the base


def run_row(label: str, run: Path) -> dict[str, str]:
    """One CSV row from a finished run directory."""
    summary = json.loads((run / "summary.json").read_text())
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    ev = summary["eval"]
    before, after = ev["attributes_before"], ev["attributes_after"]
    if PREFERENCE in before:  # a mix: its components' means are among the attributes
        jpeg = before[PREFERENCE], after[PREFERENCE]
    elif cfg["reward"]["name"] == PREFERENCE:
        jpeg = ev["before"], ev["after"]
    else:
        jpeg = float("nan"), float("nan")
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    iterations = sum(1 for row in steps if "reward_mean" in row)
    layout = json.loads((run / "profile.json").read_text()).get("chunks")
    guard = ev.get("guard") or {}
    return {
        "label": label, "reward": cfg["reward"]["name"],
        "mix_advantage": cfg["reward"]["mix_advantage"],
        "sde_window": cfg["sampling"]["sde_window"], "chunks": layout,
        "fraction": cfg["chunks"]["fraction"], "kl_ref": cfg["loss"]["kl_ref"],
        "kl_coef": cfg["loss"]["kl_coef"], "lr": cfg["optim"]["lr"],
        "precision": cfg["model"]["mixed_precision"], "iterations": iterations,
        "trained_gain": f"{ev['gain']:.4f}", "trained_gain_ci95": f"{ev['gain_ci95']:.4f}",
        "jpeg_before": f"{jpeg[0]:.4f}", "jpeg_after": f"{jpeg[1]:.4f}",
        "fidelity_before": f"{before['fidelity_score']:.4f}",
        "fidelity_after": f"{after['fidelity_score']:.4f}",
        "fidelity_gain_ci95": f"{guard['gain_ci95']:.4f}" if guard else "",
        "verdict": ev.get("verdict") or "",
    }


def collect(label: str, runs: list[Path], out: Path) -> None:
    rows = []
    if out.exists():
        with out.open() as f:
            rows = [r for r in csv.DictReader(f) if r["label"] != label]
    rows += [run_row(label if len(runs) == 1 else f"{label} ({run.name})", run) for run in runs]
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)


def plot(table: Path, out: Path) -> None:
    from chunk_grpo.train.plots import line_plot

    with table.open() as f:
        rows = list(csv.DictReader(f))
    series = {}
    for row in rows:
        fidelity = float(row["fidelity_after"]) - float(row["fidelity_before"])
        jpeg = float(row["jpeg_after"]) - float(row["jpeg_before"])
        series[f"{row['label']}: {row['iterations']} it."] = ([fidelity], [jpeg])
    gains = [ys[0] for _, ys in series.values()]
    # the floor as a series of its own, so that its colour differs from every run's
    series[f"fidelity floor {FIDELITY_FLOOR} (to its right: fidelity kept)"] = (
        [FIDELITY_FLOOR, FIDELITY_FLOOR], [min(0.0, *gains), max(gains)])
    line_plot(series, out, title="embedded default, 256 held-out images: preference reward "
              "against prompt fidelity (each point a run)",
              xlabel="fidelity_score after - before (shapes checks)",
              ylabel="jpeg_compressibility gain", size=(760, 460))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collect", help="add rows for finished runs to the CSV")
    c.add_argument("runs", nargs="+", type=Path)
    c.add_argument("--label", required=True)
    c.add_argument("--csv", type=Path, required=True)
    p = sub.add_parser("plot", help="draw the CSV's runs")
    p.add_argument("csv", type=Path)
    p.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.command == "collect":
        collect(args.label, args.runs, args.csv)
    else:
        plot(args.csv, args.out)


if __name__ == "__main__":
    main()
