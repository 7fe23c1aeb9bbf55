"""The seeds table of ``bench/default_run_seeds.sh``: held-out colour accuracy at every eval of each run (from its
``metrics.jsonl``), the final one, training and wall seconds, and whether the run met the default run's bar.

The bar (issue 26): colour accuracy >= ``FINAL_BAR`` at the end and >= ``EARLY_BAR`` at the first eval at or after
two thirds of the run. Training seconds are the sum of the logged windows (``window_s``: steps, evals and logging
from the first step to the last); wall seconds add start-up (imports, data, model) and the final export. The final
eval loss, to 6 decimals, shows whether two runs of one seed computed the same numbers.

    python bench/default_run_table.py --out table.json outputs/default_run_seeds/seed0-python.run.json ...
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import harness

FINAL_BAR = 0.95
EARLY_BAR = 0.9


def read_run(run_json: Path) -> dict:
    """One row: the run's description (``*.run.json``: seed, launcher, dir, start and end in epoch seconds) and what
    its metrics say."""
    run = json.loads(run_json.read_text())
    run["wall_s"] = run.pop("end") - run.pop("start")
    records = [json.loads(line) for line in (Path(run["dir"]) / "metrics.jsonl").read_text().splitlines() if line]
    config = json.loads((Path(run["dir"]) / "config.json").read_text())
    steps = config["train"]["max_steps"]
    evals = {r["step"]: r["eval_acc_colour"] for r in records if "eval_acc_colour" in r}
    eval_loss = next((r["eval_loss"] for r in reversed(records) if "eval_loss" in r), None)
    early_step = min((s for s in evals if 3 * s >= 2 * steps), default=None)
    final = evals.get(steps)
    early = evals.get(early_step) if early_step is not None else None
    ok = final is not None and final >= FINAL_BAR and early is not None and early >= EARLY_BAR
    train_s = sum(r.get("window_s", 0.0) for r in records)
    return {**run, "steps": steps, "evals": evals, "early_step": early_step, "final": final, "eval_loss": eval_loss,
            "train_s": train_s, "ok": ok}  # fmt: skip


def format_table(rows: list[dict]) -> str:
    steps = sorted({s for r in rows for s in r["evals"]})
    head = ["seed", "launcher", *[f"step {s}" for s in steps], "final", "final eval loss", "train s", "wall s",
            "bar met"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        accs = [f"{r['evals'][s]:.3f}" if s in r["evals"] else "" for s in steps]
        final = f"{r['final']:.3f}" if r["final"] is not None else "missing"
        launcher = "python" if r["launcher"] == "python" else "accelerate launch"
        loss = f"{r['eval_loss']:.6f}" if r["eval_loss"] is not None else ""
        cells = [str(r["seed"]), launcher, *accs, final, loss, f"{r['train_s']:.0f}", f"{r['wall_s']:.0f}",
                 "yes" if r["ok"] else "**no**"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="the *.run.json files bench/default_run_seeds.sh wrote")
    parser.add_argument("--out", type=Path, help="write the rows, the table and the machine here as JSON")
    args = parser.parse_args()
    rows = [read_run(p) for p in args.runs]
    met = sum(r["ok"] for r in rows)
    table = format_table(rows)
    bar = f"colour accuracy >= {EARLY_BAR} by two thirds, >= {FINAL_BAR} at the end"
    verdict = f"{met} of {len(rows)} runs met the bar ({bar})"
    print(f"{table}\n\n{verdict}")
    if args.out:
        harness.write_results("default_run_seeds", {"rows": rows, "table": table, "verdict": verdict}, path=args.out)
    return 0 if met == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
