"""What every config section shares: the error a config that cannot run raises, and the pydantic base of a section
(unknown keys refused, each field's docstring its help text). Re-exported by ``vlm_sft.config``."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A config that cannot run, with the fix in the message."""


class Section(BaseModel):
    """A config section: unknown keys are refused, field docstrings are the ``--help`` text, assignments validated."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True, frozen=False)
