"""Resumable training checkpoints: model and optimizer through torch distributed checkpoint (DCP), everything else in
files that cannot run code when read.

``<output_dir>/checkpoints/step-000100/`` holds the DCP shards (``.metadata``, ``__R_0.distcp``: tensors only,
resharded on load), ``trainer_state.json`` (rank 0: step, scheduler, the optimizer's param_groups, the trainer's
counters, world size), ``data-rank*.json`` (each rank's stream positions, joined into one global position on
resume), ``rng-rank*.safetensors``, ``hf/`` (the weights as an HF directory, when asked), ``MANIFEST.json``
(``checkpoint.integrity``) and ``COMPLETE``, written last. The layout, file by file: docs/outputs.md.

- **No pickle is read**: JSON and safetensors hold plain values, the DCP state tensors only (``param_groups`` go to
  ``trainer_state.json``), and DCP's pickled ``.metadata`` is read by ``parallel.dcp.SafeReader``.
- **Another world size** resumes: DCP reshards, the data position is global, and each rank restores its own RNG
  state where the checkpoint has it, else rank 0's.
- **Atomic**: a save writes ``step-N.tmp``, renamed by rank 0 once every rank finished; the last ``keep_last``
  complete ones are kept. A failed save on any rank raises ``CheckpointSaveError`` there (``PeerFailure`` on the
  others), touches no earlier checkpoint, and its ``.tmp`` is removed now or by the next save.
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file
from torch import nn

from vlm_sft.checkpoint import integrity
from vlm_sft.checkpoint.resume import (  # noqa: F401 (resolve_resume, verify_checkpoint: the trainer imports them here)
    COMPLETE_MARKER,
    checkpoints_dir,
    complete_checkpoints,
    marker_text,
    resolve_resume,
    verify_checkpoint,
)
from vlm_sft.parallel.collectives import PeerFailure, all_ranks_or_none, gather_objects
from vlm_sft.parallel.dcp import check_metadata, load_tensors, save_tensors, set_sharded_state, sharded_state
from vlm_sft.parallel.env import DistEnv
from vlm_sft.parallel.failure import agreed

logger = logging.getLogger(__name__)

_RANK_FILE = re.compile(r"^(?:__(\d+)_\d+\.distcp|data-rank(\d+)\.json|rng-rank(\d+)\.safetensors)$")
"""The files one rank writes (DCP names its shards ``__<rank>_<n>.distcp``); any other file is rank 0's."""
TRAINER_STATE = "trainer_state.json"
STATE_FORMAT = 1
"""Version of ``trainer_state.json``; another one is refused with the reason."""


def data_file(rank: int) -> str:
    return f"data-rank{rank:05d}.json"


def rng_file(rank: int) -> str:
    return f"rng-rank{rank:05d}.safetensors"


@dataclass
class TrainerState:
    """Everything besides model and optimizer that an exact resume needs (plain values: JSON and RNG tensors)."""

    step: int
    """Optimizer steps completed."""
    scheduler: dict
    """LR scheduler state dict."""
    data: dict
    """Data position: on save this rank's (``TrainBatches.state_dict()``), on load every rank's joined
    (``merge_positions``)."""
    rng: dict
    """torch / numpy / python (/ CUDA) RNG states (``capture_rng``): this rank's, or rank 0's after a resume on more
    ranks than wrote the checkpoint."""
    base_fingerprint: str | None = None
    """LoRA runs: the fingerprint of the frozen base the adapters sit on (``model.lora.base_fingerprint``); a resume
    onto another base is refused. None: a full fine-tune."""
    trackers: dict | None = None
    """Rank 0's tracker runs (``MetricsLogger.tracker_state()``): what a resume continues. None: none recorded."""
    nonfinite_steps: int = 0
    """Non-finite steps skipped before the save (``trainer.nonfinite``): a resume continues the count."""
    world_size: int = 1
    """Processes that wrote the checkpoint (set on load; informational)."""
    param_groups: list[dict] = field(default_factory=list)
    """The optimizer's hyperparameters per group as saved (set on load; a save writes the optimizer's own)."""

    def counters(self) -> dict[str, Any]:
        """The typed fields as ``trainer_state.json`` keeps them, under ``extra`` with these keys (every checkpoint's
        format, so older and newer code read each other's)."""
        return {"base": self.base_fingerprint, "trackers": self.trackers, "nonfinite_steps": self.nonfinite_steps}


def capture_rng() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_rng(path: Path, state: dict[str, Any]) -> None:
    """Tensors (torch and CUDA states, numpy's and python's Mersenne Twister words) as safetensors; the few scalars
    of numpy's and python's states as JSON in its metadata."""
    name, key, pos, has_gauss, gauss = state["numpy"]
    version, words, gauss_next = state["python"]
    tensors = {
        "torch": state["torch"].numpy(),
        "numpy_key": np.asarray(key, dtype=np.uint32),
        "python_words": np.asarray(words, dtype=np.uint32),  # 624 words and the index (<= 624): all below 2**32
    }
    for i, s in enumerate(state.get("cuda", [])):
        tensors[f"cuda.{i}"] = s.numpy()
    scalars = {"numpy": [name, int(pos), int(has_gauss), float(gauss)], "python": [version, gauss_next]}
    save_file(tensors, str(path), metadata={"scalars": json.dumps(scalars)})


def read_rng(path: Path) -> dict[str, Any]:
    with safe_open(str(path), framework="np") as f:
        scalars = json.loads(f.metadata()["scalars"])
        t = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
    name, pos, has_gauss, gauss = scalars["numpy"]
    version, gauss_next = scalars["python"]
    state = {
        "torch": torch.from_numpy(t["torch"]),
        "numpy": (name, t["numpy_key"], pos, has_gauss, gauss),
        "python": (version, tuple(int(w) for w in t["python_words"]), gauss_next),
    }
    cuda = sorted((int(k.split(".")[1]), v) for k, v in t.items() if k.startswith("cuda."))
    if cuda:
        state["cuda"] = [torch.from_numpy(v) for _, v in cuda]
    return state


def merge_positions(parts: Iterable[Mapping]) -> dict:
    """One global data position from every rank's (``TrainBatches.state_dict()``): the union of their ``streams``
    (the ranks of one context-parallel group write the same ones); everything else must agree."""
    parts = list(parts)
    first = parts[0]
    streams: dict[str, dict] = {}
    for part in parts:
        differ = sorted(k for k in first.keys() | part.keys() if k != "streams" and first.get(k) != part.get(k))
        if differ:
            raise ValueError(f"the ranks' data positions disagree on {differ}: the checkpoint is inconsistent")
        streams.update(part.get("streams", {}))
    return {**first, "streams": streams} if "streams" in first else dict(first)


# ------------------------------------------------------------------------------------------- tensors only


def _tensors_only(tree: dict, where: str) -> None:
    """DCP would pickle any non-tensor leaf (and read it back with ``torch.load(weights_only=False)``)."""
    bad = []
    stack = [(where, tree)]
    while stack:
        prefix, node = stack.pop()
        for key, value in node.items():
            if isinstance(value, dict):
                stack.append((f"{prefix}.{key}", value))
            elif not isinstance(value, torch.Tensor):
                bad.append(f"{prefix}.{key} ({type(value).__name__})")
    if bad:
        raise TypeError(f"a checkpoint's DCP state holds tensors only, not {sorted(bad)[:5]}")


# --------------------------------------------------------------------------------------------------- save


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (a full disk, no permission, ...): its ``.tmp`` folder was removed, every
    earlier checkpoint is kept, and every rank stops (the others with ``PeerFailure``)."""


def save_checkpoint(
    output_dir: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: TrainerState,
    env: DistEnv,
    keep_last: int,
    write_extra: Callable[[Path], None] | None = None,
    trainable_only: bool = False,
) -> Path:
    """Write a resumable checkpoint for ``state.step`` atomically (module docstring); every rank must call this.

    ``trainable_only`` (LoRA runs): only the parameters that train, with their optimizer state; the frozen base is
    not written, since the run rebuilds it from ``model.name_or_path`` (a 9B base would be 18 GB per checkpoint).

    ``write_extra(tmp_dir)`` runs on every rank before the checkpoint is marked complete (the trainer writes the HF
    export there), so the extra files appear and disappear together with the checkpoint, and the manifest covers them.

    A failure anywhere (any rank, any file, DCP's shards included) removes ``step-N.tmp`` and raises
    ``CheckpointSaveError`` on the failing rank, ``PeerFailure`` on the others; no earlier checkpoint is touched.
    """
    root = checkpoints_dir(output_dir)
    final = root / f"step-{state.step:06d}"
    tmp = root / f"step-{state.step:06d}.tmp"
    try:
        _write_checkpoint(tmp, final, model, optimizer, state, env, write_extra, trainable_only)
    except BaseException as err:  # every failure, DCP's CheckpointException (a BaseException) too: cleaned, re-raised
        removed = _discard(tmp, err, env)
        stop = _save_error(err, state.step, tmp, output_dir, env, removed=removed)
        if stop is err:
            raise
        raise stop from err
    with all_ranks_or_none(env, f"removing checkpoints older than the last {keep_last}"):
        if env.is_main:
            for old in complete_checkpoints(output_dir)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
            _remove_stale(root)
            logger.info("saved checkpoint %s", final)
    return final


def _remove_stale(root: Path) -> None:
    """Remove the ``step-N.tmp`` folders of saves that failed or were killed (rank 0, after a complete save). A
    ``step-N.old.tmp`` whose ``step-N`` is missing is the only copy of a checkpoint whose replacement failed to land
    (``integrity.replace_folder``): it is renamed back, never removed."""
    for stale in root.glob("step-*.tmp"):
        if stale.name.endswith(integrity.ASIDE_SUFFIX):
            home = stale.with_name(stale.name.removesuffix(integrity.ASIDE_SUFFIX))
            if not home.exists():
                stale.rename(home)
                logger.warning("restored %s from %s (its replacement never landed)", home, stale.name)
                continue
        shutil.rmtree(stale, ignore_errors=True)


def _write_checkpoint(
    tmp: Path,
    final: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: TrainerState,
    env: DistEnv,
    write_extra: Callable[[Path], None] | None,
    trainable_only: bool,
) -> None:
    """Every file into ``tmp``, the manifest (each rank hashes what it wrote), the marker, the rename to ``final``."""
    with all_ranks_or_none(env, f"preparing {tmp}"):
        if env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
    model_sd, optim_sd = sharded_state(model, optimizer, trainable_only=trainable_only)
    tensors = {"model": model_sd, "optim": {"state": optim_sd["state"]}}
    _tensors_only(tensors, "state")
    save_tensors(tensors, tmp)
    with all_ranks_or_none(env, f"writing the trainer state into {tmp}"):
        _write_json(tmp / data_file(env.rank), state.data)
        write_rng(tmp / rng_file(env.rank), state.rng)
        if env.is_main:
            main = {
                "format": STATE_FORMAT, "step": state.step, "world_size": env.world_size,
                "scheduler": state.scheduler, "param_groups": optim_sd["param_groups"], "extra": state.counters(),
            }  # fmt: skip
            _write_json(tmp / TRAINER_STATE, main)
    if write_extra is not None:
        write_extra(tmp)
    digest = integrity.write_manifest(tmp, env, writer=_writer_rank, exclude=[COMPLETE_MARKER])
    with all_ranks_or_none(env, f"completing the checkpoint {final}"):
        if env.is_main:
            (tmp / COMPLETE_MARKER).write_text(marker_text(state.step, env.world_size, digest), encoding="utf-8")
            integrity.sync_files([tmp / COMPLETE_MARKER, tmp])
            integrity.replace_folder(tmp, final)  # an earlier step-N (a re-save) aside first; the parent synced


def _writer_rank(relative: str) -> int:
    """The rank that wrote a checkpoint file (``_RANK_FILE``; everything else is rank 0's)."""
    m = _RANK_FILE.match(relative)
    return int(next(g for g in m.groups() if g is not None)) if m else 0


def _discard(tmp: Path, err: BaseException, env: DistEnv) -> bool:
    """Rank 0 removes a failed save's folder when no rank can be writing into it any more, i.e. every rank stopped at
    the same point: one process, an agreement's error (``PeerFailure`` on the others), DCP's error (every rank gets
    it). Otherwise (Ctrl-C on rank 0 alone, an error between two collectives) a peer may still be writing there: the
    folder is left to the next save, which removes every stale ``.tmp``. True when it was removed."""
    everyone = not env.distributed or agreed(err) or isinstance(err, PeerFailure) or bool(_dcp_failures(err))
    if not (env.is_main and everyone):
        return False
    shutil.rmtree(tmp, ignore_errors=True)
    if tmp.exists():
        logger.warning("could not remove the failed save's folder %s; the next save removes it", tmp)
    return not tmp.exists()


def _save_error(
    err: BaseException, step: int, tmp: Path, output_dir: str | Path, env: DistEnv, *, removed: bool
) -> BaseException:
    """What a failed save raises on this rank: the failing rank a ``CheckpointSaveError`` naming the folder and the
    cause, the others ``PeerFailure``; an interrupt or a peer's failure unchanged."""
    failures = _dcp_failures(err)
    if isinstance(err, PeerFailure) or not (failures or isinstance(err, Exception)):
        return err
    if failures:
        reasons = {r: _reason(e[0]) for r, e in failures.items()}
        if env.rank != min(reasons):
            return PeerFailure(f"writing the checkpoint shards into {tmp}", reasons)
        reason = reasons[min(reasons)]
    else:
        reason = str(err) if isinstance(err, CheckpointSaveError) else _reason(err)  # the HF export's, inside
    kept = [p.name for p in complete_checkpoints(output_dir)]
    left = f"Removed {tmp.name}" if removed else f"Left {tmp.name} (the next save removes it)"
    return CheckpointSaveError(
        f"could not save the checkpoint of step {step} into {tmp}: {reason}. {left}; the earlier "
        f"checkpoints are kept ({', '.join(kept) or 'none yet'}). Free space (or fix the permissions) under "
        f"{tmp.parent}, then resume with --train.resume latest"
    )


def _dcp_failures(err: BaseException) -> dict:
    """DCP's ``CheckpointException`` (a BaseException every rank gets, which ``checkpoint`` may not import: it is
    ``torch.distributed``'s) carries ``failures``: {rank: (exception, traceback)}."""
    failures = getattr(err, "failures", None)
    return failures if type(err).__name__ == "CheckpointException" and isinstance(failures, dict) else {}


def _reason(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=1) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------------------------------- load


def _read_json(path: Path) -> Any:
    """A JSON file of the checkpoint; anything else is an error that says so (it is never unpickled)."""
    if not path.is_file():
        if (path.parent / "rank00000.pt").is_file():
            raise ValueError(
                f"{path.parent} was written by an older vlm-sft whose trainer state is a pickle (rank00000.pt), which "
                "is never read, since a pickle can run code; start afresh from its weights "
                f"(model.name_or_path = '{path.parent / 'hf'}')"
            )
        raise FileNotFoundError(f"{path} is missing: {path.parent} is not a complete checkpoint of this vlm-sft")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not JSON ({err}): a damaged checkpoint, or a file from elsewhere") from err


def _read(path: Path, env: DistEnv) -> TrainerState:
    """The plain-format part of a checkpoint, the optimizer's param_groups included; every rank reads its own RNG file
    (rank 0's when the checkpoint has no file for this rank) and its share of the data files (``_read_positions``)."""
    with all_ranks_or_none(env, f"opening the checkpoint {path}"):
        main = _read_json(path / TRAINER_STATE)
        if main.get("format") != STATE_FORMAT:
            raise ValueError(
                f"{path / TRAINER_STATE} has format {main.get('format')!r}; this code reads {STATE_FORMAT}"
            )
        world = int(main["world_size"])
        rng_rank = env.rank if env.rank < world else 0
        try:
            rng = read_rng(path / rng_file(rng_rank))
        except SafetensorError as err:
            raise ValueError(f"{path / rng_file(rng_rank)} is not an RNG state file ({err})") from err
    data = _read_positions(path, world, env)
    if rng_rank != env.rank:
        logger.info("rank %d: %s was written by %d processes; restoring rank 0's RNG state", env.rank, path, world)
    extra = main.get("extra") or {}  # a checkpoint of an older vlm-sft may lack a counter: its default
    return TrainerState(
        step=main["step"], scheduler=main["scheduler"], data=data, rng=rng, base_fingerprint=extra.get("base"),
        trackers=extra.get("trackers"), nonfinite_steps=int(extra.get("nonfinite_steps", 0)), world_size=world,
        param_groups=main["param_groups"],
    )  # fmt: skip


def _read_positions(path: Path, world: int, env: DistEnv) -> dict:
    """The global data position from the ``world`` ranks' data files: each rank reads every ``world_size``-th file
    and the parts are gathered, so each file is opened once per resume, not once per rank (a 256-rank job: 256
    opens on the shared filesystem, not 65,536); every rank must call this."""
    with all_ranks_or_none(env, f"reading the data positions in {path}"):
        mine = {r: _read_json(path / data_file(r)) for r in range(env.rank, world, env.world_size)}
    parts = {r: part for share in gather_objects(mine, env) for r, part in share.items()}
    with all_ranks_or_none(env, f"joining the data positions in {path}"):
        return merge_positions(parts[r] for r in range(world))


def read_trainer_state(path: str | Path, *, env: DistEnv) -> TrainerState:
    """A checkpoint's trainer state without the model and optimizer (cheap: JSON and the RNG file), e.g. to check
    the data position before a long DCP load; every rank must call this. ``load_checkpoint`` takes it back."""
    return _read(Path(path), env)


def load_checkpoint(
    path: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    env: DistEnv,
    trainable_only: bool = False,
    state: TrainerState | None = None,
) -> TrainerState:
    """Restore model and optimizer in place from ``path`` (any world size: DCP reshards) and return the trainer
    state; every rank must call this. Every parameter (or, ``trainable_only``, every trainable one) and its
    optimizer state is overwritten from DCP, so the model may come in uninitialized (``to_empty``); its
    non-persistent buffers are not in a checkpoint and must be set by whoever built it. ``trainable_only`` must match
    the save's: a LoRA run restores its adapters onto the rebuilt frozen base. The files are read as they are: the
    trainer checks them against the manifest first (``resolve_resume``), so each byte is hashed once per resume.
    ``state``: what ``read_trainer_state`` already read of ``path`` (None: read here), so a resume reads it once."""
    path = Path(path)
    state = _read(path, env) if state is None else state
    with all_ranks_or_none(env, f"reading the DCP metadata of {path}"):
        check_metadata(path)  # a refused file stops here, not inside DCP's collectives
    model_sd, optim_sd = sharded_state(model, optimizer, trainable_only=trainable_only)
    tensors = {"model": model_sd, "optim": {"state": optim_sd["state"]}}
    load_tensors(tensors, path)
    groups = _restore_groups(optim_sd["param_groups"], state.param_groups, path)
    optim = {"state": tensors["optim"]["state"], "param_groups": groups}
    set_sharded_state(model, optimizer, tensors["model"], optim, trainable_only=trainable_only)
    logger.info("resumed from %s at step %d (written by %d process(es))", path, state.step, state.world_size)
    return state


def _restore_groups(current: list[dict], saved: list[dict], path: Path) -> list[dict]:
    """The saved hyperparameters on this run's parameter groups, with the types the optimizer uses (JSON turned
    tuples such as AdamW's ``betas`` into lists)."""
    if [g["params"] for g in saved] != [g["params"] for g in current]:
        raise ValueError(
            f"{path}: the optimizer's parameter groups hold other parameters than this run's "
            f"({[len(g['params']) for g in saved]} vs {[len(g['params']) for g in current]} per group); resume with "
            "the model and LoRA settings the checkpoint was trained with"
        )
    return [
        {**now, **{k: tuple(v) if isinstance(now.get(k), tuple) else v for k, v in old.items()}}
        for now, old in zip(current, saved, strict=True)
    ]
