"""Sample accounting: where every sample drawn from the data went (packed, skipped with a reason, or still buffered).

A run over real data must say what it dropped. Each pipeline keeps a ``SkipReport`` (counts per reason, the first few
rows of each with the error's detail) and counters; ``DataAccounting`` adds them up over a rank's workers and over
ranks, checks that they balance (seen == packed + skipped + buffered) and formats the report that the trainer logs at
the end of every pass and of the run, writes to ``data_accounting.json`` and that the data report prints.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from renderers.errors import SampleError

MAX_EXAMPLES = 5
"""Example rows kept per skip reason."""


@dataclass
class SkipReport:
    """Skipped samples by reason: a count and the first few rows of each, with the error's detail (an accumulator)."""

    counts: dict[str, int] = field(default_factory=dict)
    """reason -> number of skipped samples."""
    examples: dict[str, list[dict]] = field(default_factory=dict)
    """reason -> up to ``max_examples`` ``{"row": index, "detail": text}``, in the order they were skipped."""
    max_examples: int = MAX_EXAMPLES
    """How many examples to keep per reason."""

    def add(self, err: SampleError) -> None:
        self.counts[err.reason] = self.counts.get(err.reason, 0) + 1
        ex = self.examples.setdefault(err.reason, [])
        if len(ex) < self.max_examples:
            ex.append({"row": err.sample_index, "detail": err.detail})

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def to_dict(self) -> dict[str, dict]:
        """``{reason: {"count": n, "examples": [{"row", "detail"}]}}``, most frequent first."""
        order = sorted(self.counts, key=lambda r: (-self.counts[r], r))
        return {r: {"count": self.counts[r], "examples": [dict(e) for e in self.examples.get(r, [])]} for r in order}

    def load(self, state: Mapping[str, Mapping]) -> None:
        self.counts = {r: int(v["count"]) for r, v in state.items()}
        self.examples = {r: [_example(e) for e in v["examples"]] for r, v in state.items()}

    def merge(self, other: Mapping[str, Mapping]) -> None:
        """Add another report's ``to_dict()`` (examples kept up to ``max_examples`` per reason)."""
        for reason, info in other.items():
            self.counts[reason] = self.counts.get(reason, 0) + int(info["count"])
            ex = self.examples.setdefault(reason, [])
            ex.extend(_example(e) for e in info["examples"][: max(0, self.max_examples - len(ex))])


def _example(e: Mapping) -> dict:
    """A copy of an example row (``{"row", "detail"}``) as plain values."""
    return {"row": int(e["row"]), "detail": str(e["detail"])}


@dataclass
class SourceCounts:
    """One source of a mixture: samples drawn, packed and skipped (with reasons), and the tokens it packed."""

    seen: int = 0
    packed: int = 0
    skips: SkipReport = field(default_factory=SkipReport)
    """Skips by reason; example rows are rows of this source."""
    real_tokens: int = 0
    """Tokens of this source's packed samples (inputs, after truncation and the shift)."""
    trainable_tokens: int = 0
    """Of those, the positions trained on."""

    @property
    def skipped(self) -> int:
        return self.skips.total

    @property
    def skip_fraction(self) -> float:
        return self.skipped / self.seen if self.seen else 0.0

    def add(self, other: SourceCounts) -> None:
        self.seen += other.seen
        self.packed += other.packed
        self.real_tokens += other.real_tokens
        self.trainable_tokens += other.trainable_tokens
        self.skips.merge(other.skips.to_dict())

    def to_dict(self) -> dict:
        return {
            "seen": self.seen,
            "packed": self.packed,
            "skipped": self.skips.to_dict(),
            "samples_skipped": self.skipped,
            "buffered": self.seen - self.packed - self.skipped,
            "real_tokens": self.real_tokens,
            "trainable_tokens": self.trainable_tokens,
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> SourceCounts:
        skips = SkipReport()
        skips.load(d.get("skipped", {}))
        return cls(int(d["seen"]), int(d["packed"]), skips, int(d["real_tokens"]), int(d["trainable_tokens"]))


@dataclass
class DataAccounting:
    """Where the samples drawn so far went, summed over pipelines (workers, ranks)."""

    seen: int = 0
    """Samples drawn from the data (every pass counts again)."""
    packed: int = 0
    """Samples in packs handed to the trainer (or the report)."""
    skips: SkipReport = field(default_factory=SkipReport)
    """Samples dropped, by reason, with examples."""
    pass_ends: list[list[int]] = field(default_factory=list)
    """``[seen, packed, skipped]`` at the end of each completed pass (cumulative; nothing is buffered there). When
    pipelines are summed, only the passes all of them completed."""
    sources: dict[str, SourceCounts] = field(default_factory=dict)
    """Per source of a mixture (empty for one source): the same counts, which add up to the totals."""

    @property
    def passes(self) -> int:
        """Completed passes over the data (the least of the summed pipelines)."""
        return len(self.pass_ends)

    def end_pass(self) -> None:
        """Record the counts at the end of a pass (the packer was flushed and drained: they balance exactly)."""
        self.pass_ends.append([self.seen, self.packed, self.skipped])

    def pass_counts(self, number: int) -> dict[str, int]:
        """Seen / packed / skipped in pass ``number`` (1-based) alone."""
        end = self.pass_ends[number - 1]
        start = self.pass_ends[number - 2] if number > 1 else [0, 0, 0]
        return dict(zip(("seen", "packed", "skipped"), (e - s for e, s in zip(end, start, strict=True)), strict=True))

    def count_seen(self, source: str | None) -> None:
        self.seen += 1
        if source is not None:
            self.sources.setdefault(source, SourceCounts()).seen += 1

    def count_skip(self, err: SampleError, source: str | None = None, row: int | None = None) -> None:
        """A skipped sample; for a mixture's, the source's report names its own ``row`` and the total's detail
        names the source."""
        if source is None:
            self.skips.add(err)
            return
        local = type(err)(err.reason, err.detail, sample_index=-1 if row is None else row)
        self.sources.setdefault(source, SourceCounts()).skips.add(local)
        self.skips.add(type(err)(err.reason, f"[{source}] {err.detail}".rstrip(), sample_index=local.sample_index))

    def count_packed(self, source: str | None, real_tokens: int, trainable_tokens: int) -> None:
        self.packed += 1
        if source is not None:
            counts = self.sources.setdefault(source, SourceCounts())
            counts.packed += 1
            counts.real_tokens += real_tokens
            counts.trainable_tokens += trainable_tokens

    @property
    def skipped(self) -> int:
        return self.skips.total

    @property
    def buffered(self) -> int:
        """Samples accepted but not yet in a pack handed out (the packer's look-ahead and packs in flight)."""
        return self.seen - self.packed - self.skipped

    @property
    def skip_fraction(self) -> float:
        return self.skipped / self.seen if self.seen else 0.0

    @classmethod
    def from_pipeline_states(cls, states: Iterable[Mapping]) -> DataAccounting:
        """The sum over ``PackingPipeline.state_dict()`` values (e.g. one per worker of a rank)."""
        return cls.total(cls.from_dict(state["accounting"]) for state in states)

    @classmethod
    def total(cls, parts: Iterable[DataAccounting]) -> DataAccounting:
        """The sum of ``parts``; its passes are those every part completed."""
        parts = list(parts)
        out = cls()
        for part in parts:
            out.seen += part.seen
            out.packed += part.packed
            out.skips.merge(part.skips.to_dict())
            for name, counts in part.sources.items():
                out.sources.setdefault(name, SourceCounts()).add(counts)
        common = min((part.passes for part in parts), default=0)
        out.pass_ends = [[sum(part.pass_ends[i][k] for part in parts) for k in range(3)] for i in range(common)]
        return out

    def to_dict(self) -> dict:
        return {
            "samples_seen": self.seen,
            "samples_packed": self.packed,
            "samples_skipped": self.skipped,
            "samples_buffered": self.buffered,
            "passes": self.passes,
            "pass_ends": [list(e) for e in self.pass_ends],
            "skipped": self.skips.to_dict(),
            **({"sources": {n: c.to_dict() for n, c in self.sources.items()}} if self.sources else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> DataAccounting:
        skips = SkipReport()
        skips.load(d.get("skipped", {}))
        ends = [[int(v) for v in e] for e in d.get("pass_ends", [])]
        sources = {n: SourceCounts.from_dict(c) for n, c in d.get("sources", {}).items()}
        return cls(
            seen=int(d["samples_seen"]), packed=int(d["samples_packed"]), skips=skips, pass_ends=ends, sources=sources
        )

    def check(self) -> None:
        """Raise when the counts do not balance (a sample lost or counted twice: a bug, never bad data)."""
        if self.buffered < 0:
            raise AssertionError(f"sample accounting does not balance: {self.to_dict()}")
        if self.sources:
            sums = [sum(getattr(c, k) for c in self.sources.values()) for k in ("seen", "packed", "skipped")]
            if sums != [self.seen, self.packed, self.skipped] or any(
                c.seen < c.packed + c.skipped for c in self.sources.values()
            ):
                raise AssertionError(f"per-source sample accounting does not add up to the totals: {self.to_dict()}")

    def format(self, title: str = "data", weights: Mapping[str, float] | None = None) -> str:
        """The report as text: counts, then every skip reason with its example rows and their details, then one line
        per source of a mixture (with the share its weight asks for, when ``weights`` are given)."""
        lines = [
            f"{title}: {self.seen} samples seen, {self.packed} packed, {self.skipped} skipped "
            f"({100 * self.skip_fraction:.1f}%), {self.buffered} buffered; {self.passes} full pass(es)"
        ]
        lines += format_skips(self.skips.to_dict())
        lines += format_sources({n: c.to_dict() for n, c in self.sources.items()}, weights)
        return "\n".join(lines)


def format_sources(sources: Mapping[str, Mapping], weights: Mapping[str, float] | None = None) -> list[str]:
    """One line per source of a mixture: its samples, skips and tokens, and its share of the samples drawn (beside
    the share its weight asks for, when ``weights`` are given)."""
    if not sources:
        return []
    seen = sum(c["seen"] for c in sources.values()) or 1
    total_weight = sum(weights.values()) if weights else 0.0
    lines = ["  per source:"]
    for name, c in sources.items():
        share = f"{100 * c['seen'] / seen:5.1f}% of draws"
        if weights and name in weights:
            share += f" (weight asks {100 * weights[name] / total_weight:.1f}%)"
        lines.append(
            f"    {name:<20} {c['seen']:>8} seen {c['packed']:>8} packed {c['samples_skipped']:>6} skipped  {share}; "
            f"{c['trainable_tokens']} trainable of {c['real_tokens']} tokens"
        )
    return lines


def format_skips(skipped: Mapping[str, Mapping]) -> list[str]:
    """One line per reason with its count, then one indented line per example row: ``row 17: <detail>``."""
    lines = []
    for reason, info in skipped.items():
        lines.append(f"  {reason:<28}{info['count']:>8}")
        for e in info["examples"]:
            lines.append(f"      row {e['row']}: {e['detail'] or '(no detail)'}")
    return lines
