"""Which checkpoint a run resumes from, and whether it is intact: the layout of ``<output_dir>/checkpoints`` (the
``step-N`` folders ``checkpoint.state`` writes, each made complete by its ``COMPLETE`` marker) and ``train.resume``.

The marker is written last, just before the rename, and records the digest of the checkpoint's ``MANIFEST.json``
(``checkpoint.integrity``), which records every other file's size and digest::

    step 200, world size 8
    manifest MANIFEST.json sha256:5be1...

So a resume checks, before it reads anything, that every file is as written (``verify_checkpoint``): a file missing,
cut short or with other bytes, the manifest itself changed, or the marker of a renamed folder lost. ``latest`` skips
such a checkpoint with a warning and resumes from the newest intact one, setting the damaged ones aside as
``step-N.damaged`` (kept for inspection; no longer a checkpoint: a later save's ``keep_last`` would otherwise count a
damaged one of another step and delete an intact one to keep it); a damaged checkpoint named by path is a
``ConfigError`` (exit 2) naming the file. A marker without a manifest line and a folder without a manifest: a
checkpoint of an older vlm-sft, taken with a warning.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from vlm_sft.checkpoint import integrity
from vlm_sft.config import ConfigError
from vlm_sft.parallel.collectives import all_ranks_or_none, gather_objects
from vlm_sft.parallel.env import DistEnv

logger = logging.getLogger(__name__)

COMPLETE_MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_MANIFEST_LINE = re.compile(r"^manifest \S+ (\S+:[0-9a-f]+)$")


def marker_text(step: int, world_size: int, manifest_digest: str) -> str:
    """What ``COMPLETE`` holds: the step, the world size, and the digest ``integrity.write_manifest`` returned."""
    return f"step {step}, world size {world_size}\nmanifest {integrity.MANIFEST} {manifest_digest}\n"


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / COMPLETE_MARKER).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


_LOCAL = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
"""A caller outside a distributed job (tests, tools): checks run in this process alone."""


def resolve_resume(resume: str | None, output_dir: str | Path, *, env: DistEnv = _LOCAL) -> Path | None:
    """The checkpoint ``train.resume`` names, checked against its manifest before anything of it is read; every rank
    must call this (it holds collectives and its own agreements), and every rank gets the same answer.

    ``latest``: the newest intact checkpoint, None when there is none yet. A newer damaged one (a file missing,
    truncated or changed, its ``COMPLETE`` marker lost) is skipped with a warning naming the file and why; when every
    checkpoint is damaged, an error (starting afresh instead would silently throw the run's progress away). A path:
    it must be complete (else ``FileNotFoundError``) and intact (else ``ConfigError`` naming the file, with the fix).
    A checkpoint without a manifest (an older vlm-sft's) is taken with a warning."""
    if resume is None:
        return None
    if resume == "latest":
        return _latest_intact(output_dir, env)
    path = Path(resume)
    with all_ranks_or_none(env, f"finding the checkpoint {path}"):
        if not (path / COMPLETE_MARKER).is_file():
            raise FileNotFoundError(
                f"train.resume = {resume!r} is not a complete checkpoint (no {COMPLETE_MARKER} marker); "
                f"use 'latest' or one of {[str(p) for p in complete_checkpoints(output_dir)]}"
            )
    verdict = verify_checkpoint(path, env)
    with all_ranks_or_none(env, f"checking the checkpoint {path}"):
        if not verdict.ok:
            others = [str(p) for p in complete_checkpoints(output_dir) if p.resolve() != path.resolve()]
            raise ConfigError(
                f"train.resume = {resume!r} is a damaged checkpoint: {verdict.describe()}. Name another checkpoint "
                f"({others or 'there is none in ' + str(checkpoints_dir(output_dir))}) or set train.resume = "
                "'latest', which resumes from the newest intact one"
            )
    _warn_unchecked(verdict, env)
    return path


def _latest_intact(output_dir: str | Path, env: DistEnv) -> Path | None:
    """``resolve_resume("latest")``: the step folders rank 0 sees, newest first, each checked until one is intact."""
    root = checkpoints_dir(output_dir)
    with all_ranks_or_none(env, f"listing the checkpoints in {root}"):
        found = sorted(_step_folders(root), reverse=True) if env.is_main else []
    skipped: list[str] = []
    damaged: list[Path] = []
    for _, path in gather_objects(found, env)[0]:  # rank 0's list: every rank checks the same folders
        verdict = verify_checkpoint(path, env)  # every rank is done reading ``path`` when this returns
        if verdict.ok:
            if skipped and env.is_main:
                logger.warning("train.resume = 'latest': resuming from %s, the newest intact checkpoint", path)
            _set_aside(damaged, env)
            _warn_unchecked(verdict, env)
            return path
        damaged.append(path)
        skipped.append(verdict.describe())
        if env.is_main:
            logger.warning(
                "train.resume = 'latest': skipping the damaged checkpoint %s (%s); trying the next older one",
                path, verdict.describe(),
            )  # fmt: skip
    with all_ranks_or_none(env, f"finding the newest intact checkpoint in {root}"):
        if skipped:
            raise ConfigError(
                f"train.resume = 'latest' found no intact checkpoint in {root}, only damaged ones: {skipped}. Repair "
                "or remove them; to start afresh instead, leave train.resume unset or set another train.output_dir"
            )
    return None


def _set_aside(damaged: list[Path], env: DistEnv) -> None:
    """Rename each damaged step folder to ``step-N.damaged`` (``.damaged.2``, ... if taken): out of every later
    ``latest`` and ``keep_last``, its files kept. Only once an intact checkpoint is found: with none, the run stops
    and the folders stay as they were (renaming them would make the next ``latest`` start afresh in silence)."""
    with all_ranks_or_none(env, "setting damaged checkpoints aside"):
        for path in damaged if env.is_main else []:
            target, n = path.with_name(path.name + ".damaged"), 1
            while target.exists():
                n += 1
                target = path.with_name(f"{path.name}.damaged.{n}")
            path.rename(target)
            logger.warning(
                "train.resume = 'latest': set the damaged %s aside as %s (delete it when done)", path, target
            )


def _step_folders(root: Path) -> list[tuple[int, Path]]:
    """Every ``step-N`` folder (not ``.tmp``) with its step, complete or not: a renamed folder without its marker
    lost it after the save (the marker is written before the rename), so ``latest`` reports it rather than pass it
    by in silence."""
    if not root.is_dir():
        return []
    return [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]


def verify_checkpoint(path: str | Path, env: DistEnv = _LOCAL) -> integrity.Verdict:
    """``path``'s files against its manifest, whose own digest its ``COMPLETE`` marker records
    (``integrity.verify``); every rank must call this, and every rank gets the same verdict."""
    path = Path(path)
    marker = path / COMPLETE_MARKER
    damage, expected = None, None
    try:
        lines = marker.read_text(encoding="utf-8").splitlines()
        expected = next((m.group(1) for line in lines if (m := _MANIFEST_LINE.match(line))), None)
    except FileNotFoundError:
        damage = integrity.Damage(str(marker), "missing, though the folder was renamed into place after it was written")
    except (OSError, UnicodeDecodeError) as err:
        damage = integrity.Damage(str(marker), f"cannot be read ({err})")
    found = sorted({d for d in gather_objects(damage, env) if d is not None})
    if found:
        return integrity.Verdict(path, tuple(found), has_manifest=False)
    return integrity.verify(path, env, expected=expected)


def _warn_unchecked(verdict: integrity.Verdict, env: DistEnv) -> None:
    if not verdict.has_manifest and env.is_main:
        logger.warning(
            "%s has no %s (written by an older vlm-sft): its files cannot be checked; resuming from it as it is",
            verdict.folder, integrity.MANIFEST,
        )  # fmt: skip
