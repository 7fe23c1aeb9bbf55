"""The trainer's sample accounting: every run says what it trained on and what it skipped, and why.

Counts travel in the step's one all-reduce (samples seen / packed / skipped over all ranks, for ``metrics.jsonl``).
The full report, skip reasons with example rows and their details, is gathered from every rank only at moments all
ranks reach together: when every rank has finished another pass over its data, and at the end of the run. Rank 0
logs it and writes ``<output_dir>/data_accounting.json``. The counts are those of the batches the trainer consumed
(workers' look-ahead is not counted), so seen == packed + skipped + buffered, buffered being the samples in the
packers' look-ahead.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

import torch

from vlm_sft.data.accounting import DataAccounting
from vlm_sft.parallel.collectives import all_reduce, gather_objects
from vlm_sft.parallel.env import DistEnv
from vlm_sft.trainer.batches import TrainBatches

logger = logging.getLogger(__name__)

ACCOUNTING_FILE = "data_accounting.json"


class RunAccounting:
    """Accounting of one run's training data over all ranks (every rank holds one; rank 0 reports)."""

    COUNTS = ("samples_seen", "samples_packed", "samples_skipped")
    """The counts carried in each step's all-reduce (summed over ranks)."""

    def __init__(
        self,
        out_dir: Path,
        env: DistEnv,
        batches: TrainBatches,
        *,
        replica: bool = False,
        weights: Mapping[str, float] | None = None,
    ) -> None:
        self.path = out_dir / ACCOUNTING_FILE
        self.env = env
        self.batches = batches
        self.replica = replica
        """This rank loads the same samples as another (a context-parallel group's rank > 0): counted once, there."""
        self.weights = dict(weights or {})
        """A mixture's sources and weights, in config order (empty for one source): ``metrics.jsonl`` carries each
        source's samples seen as ``samples/<name>``, and the reports its realized share beside the weight's."""
        # After a resume the pipelines' states say how many passes are done; every rank starts from the least.
        local = torch.tensor([batches.accounting().passes], dtype=torch.float64)
        self.passes_reported = int(all_reduce(local, env, "min"))
        self.history: list[dict] = []

    @property
    def width(self) -> int:
        """How many values ``local_values`` returns (the same on every rank)."""
        return len(self.COUNTS) + len(self.weights) + 1

    def local_values(self) -> list[float]:
        """This rank's part of the step's all-reduce: the counts, then 1 if it finished the next unreported pass."""
        acc = self.batches.accounting()
        counts = [float(acc.seen), float(acc.packed), float(acc.skipped)]
        counts += [float(acc.sources[n].seen if n in acc.sources else 0) for n in self.weights]
        if self.replica:
            counts = [0.0] * len(counts)
        return [*counts, float(acc.passes > self.passes_reported)]

    def after_step(self, totals: list[float], step: int) -> dict[str, int]:
        """The summed counts for the metrics; reports the pass when every rank has finished it."""
        if int(totals[-1]) == self.env.world_size:
            self.passes_reported += 1
            self.report(step, f"pass {self.passes_reported} over the training data", pass_number=self.passes_reported)
        names = [*self.COUNTS, *(f"samples/{n}" for n in self.weights)]
        return dict(zip(names, (int(v) for v in totals[:-1]), strict=True))

    def report(self, step: int, when: str, pass_number: int | None = None) -> DataAccounting:
        """Gather every rank's accounting; rank 0 logs it and rewrites ``data_accounting.json``. All ranks call it.

        For the end of a pass, the pass's own counts come first (they balance exactly: seen == packed + skipped);
        the running totals after them include the next pass's look-ahead (``buffered``)."""
        mine = None if self.replica else self.batches.accounting().to_dict()
        per_rank = [d for d in gather_objects(mine, self.env) if d is not None]
        total = DataAccounting.total(DataAccounting.from_dict(d) for d in per_rank)
        total.check()
        if self.env.is_main:
            entry = {"step": step, "when": when, **_counts(total)}
            text = total.format(f"data after step {step} ({when}), running totals", weights=self.weights)
            if pass_number is not None and total.passes >= pass_number:
                counts = total.pass_counts(pass_number)
                entry["pass"] = {"number": pass_number, **counts}
                text = (
                    f"data pass {pass_number} done at step {step}: {counts['seen']} samples seen = "
                    f"{counts['packed']} packed + {counts['skipped']} skipped\n{text}"
                )
            self.history.append(entry)
            logger.info("%s", text)
            record = {"step": step, **total.to_dict(), "per_rank": [_counts_of(d) for d in per_rank]}
            record["history"] = self.history
            self.path.write_text(json.dumps(record, indent=2) + "\n")
        return total


def _counts(acc: DataAccounting) -> dict:
    return _counts_of(acc.to_dict())


def _counts_of(d: dict) -> dict:
    return {k: v for k, v in d.items() if k not in ("skipped", "pass_ends")}
