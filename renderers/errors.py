"""Typed errors for bad input. The dataset layer turns each into a counted skip, never a crash or a silent change.

Every error carries a short machine-readable ``reason`` (the key of the skip report) and the ``sample_index`` of the
dataset row, so a user can find the row that failed.
"""

from __future__ import annotations


class SampleError(ValueError):
    """A sample that cannot be trained on, with the reason and the dataset row it came from."""

    def __init__(self, reason: str, detail: str = "", *, sample_index: int = -1) -> None:
        self.reason = reason
        """Short stable key, e.g. ``corrupt_image`` or ``no_trainable_tokens``: the skip report counts by it."""
        self.detail = detail
        """Human-readable explanation, naming the offending value where it helps."""
        self.sample_index = sample_index
        """Row index in the source dataset (-1 when unknown at the point of raising)."""
        where = f"sample {sample_index}" if sample_index >= 0 else "sample"
        super().__init__(f"{where}: {reason}" + (f": {detail}" if detail else ""))

    def with_index(self, sample_index: int) -> SampleError:
        """The same error, naming the dataset row (the renderer does not know it; the dataset layer does)."""
        err = type(self)(self.reason, self.detail, sample_index=sample_index)
        err.__cause__ = self.__cause__ or self
        return err


class RenderError(SampleError):
    """The renderer could not turn a conversation into tokens (bad image, bad structure, unsupported block)."""


class SkipSample(SampleError):
    """A later data stage (truncation, vision budget) decided that a rendered sample cannot be kept."""
