"""Which files a local source names: one file, a folder of shards, or a local snapshot of a hub dataset repo with its
subsets, for prepared and streamed sources alike.

Compute nodes of a cluster often have no internet, so users download a hub dataset once (``hf download ORG/NAME
--repo-type dataset --local-dir data/NAME``) and point the trainer at the folder. Such a folder is read the
way ``datasets.load_dataset`` reads the hub repo:

- a ``README.md`` whose YAML lists ``configs:`` (each a subset with its ``data_files`` per split): ``subset`` names
  one (None: the only one, or the one marked ``default``), ``split`` picks its files;
- otherwise ``subset`` names a subfolder of shards, whose files are split by name as ``datasets`` does (``train-*``,
  ``test-*``, ... ; files without a split keyword are ``train``);
- otherwise a folder with data files at its top is read whole (every ``.jsonl`` / ``.json`` / ``.parquet`` file in
  it, one split), and a folder whose data files all lie in subfolders is read whole by split, recursively.

The parsing of the card and the file patterns are ``datasets``' own (``MetadataConfigs``, ``get_data_patterns``,
``DataFilesList``). A subset that is missing or unknown, or a split the subset lacks, raises ``SnapshotError``
naming what exists.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from datasets.data_files import DataFilesList, get_data_patterns, sanitize_patterns
from datasets.utils.metadata import MetadataConfigs
from huggingface_hub import DatasetCardData
from huggingface_hub.repocard import metadata_load

from vlm_sft.config_base import ConfigError

logger = logging.getLogger(__name__)

DataKind = Literal["parquet", "json"]
"""The ``datasets`` builder that reads local files."""

DATA_SUFFIXES: dict[str, DataKind] = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}
"""File name endings read as data, and their builder."""

CARD = "README.md"
"""The dataset card, whose YAML front matter may list the repo's ``configs:`` (subsets)."""


class SnapshotError(ConfigError):
    """A local source whose files cannot be picked: an unknown or missing subset, a missing split, no data files."""


@dataclass(frozen=True)
class DataFiles:
    """The files of one local source, and how they were found."""

    kind: DataKind
    """How to read them (all files of a source have one format)."""
    files: tuple[str, ...]
    """Absolute paths, in sorted order (the order decides which data stream reads which file)."""
    layout: str
    """How they were picked, for the start log: ``file``, ``folder``, ``README.md configs``, ``subfolder``."""
    subset: str | None = None
    """The subset read, where the folder has subsets."""


def snapshot_files(path: str | os.PathLike, *, subset: str | None = None, split: str = "train") -> DataFiles:
    """The data files of the local file or folder ``path`` for ``subset`` and ``split`` (the module docstring's
    rules)."""
    path = Path(path).expanduser()
    if path.is_file():
        if subset is not None:
            raise SnapshotError(f"subset = {subset!r}, but {path} is one file; a subset names part of a folder")
        return _data_files([path], path, "file")
    configs = card_configs(path)
    if configs:
        return _config_files(path, configs, subset, split)
    if subset is not None:
        folder = path / subset
        if not folder.is_dir():
            raise SnapshotError(f"{path} has no subset {subset!r}; its subsets: {_names(subfolder_subsets(path))}")
        return _data_files(_split_files(folder, split), folder, "subfolder", subset)
    top = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in DATA_SUFFIXES)
    if top:
        return _data_files(top, path, "folder")
    return _data_files(_split_files(path, split), path, "folder")


def card_configs(folder: Path) -> MetadataConfigs:
    """The ``configs:`` of the folder's dataset card (empty without a card or without configs)."""
    card = folder / CARD
    if not card.is_file():
        return MetadataConfigs()
    return MetadataConfigs.from_dataset_card_data(DatasetCardData(**(metadata_load(card) or {})))


def subfolder_subsets(folder: Path) -> list[str]:
    """Subfolders that hold data files (a snapshot without ``configs:`` has one per subset)."""
    return sorted(
        p.name
        for p in folder.iterdir()
        if p.is_dir() and not _hidden(p.name) and any(_is_data(f, folder) for f in p.rglob("*"))
    )


def subsets(path: str | os.PathLike) -> list[str]:
    """The subsets a local folder offers (its card's configs, else its subfolders of data files); [] for a file."""
    path = Path(path).expanduser()
    if not path.is_dir():
        return []
    return list(card_configs(path)) or subfolder_subsets(path)


def _config_files(folder: Path, configs: MetadataConfigs, subset: str | None, split: str) -> DataFiles:
    if subset is None:
        subset = configs.get_default_config_name()
        if subset is None:
            raise SnapshotError(
                f'{folder} has {len(configs)} subsets ({_names(list(configs))}); name one with subset = "..." '
                "(one [[data.sources]] table per subset to mix several)"
            )
    if subset not in configs:
        raise SnapshotError(f"{folder} has no subset {subset!r}; its subsets ({CARD} configs): {_names(list(configs))}")
    config = configs[subset]
    base = folder / config.get("data_dir", "")
    if config.get("data_files") is None:
        return _data_files(_split_files(base, split), folder, f"{CARD} configs", subset)
    patterns = sanitize_patterns(config["data_files"])
    if split not in patterns:
        raise SnapshotError(
            f"subset {subset!r} of {folder} has no split {split!r}; its splits: {_names(list(patterns))}"
        )
    try:
        found = DataFilesList.from_patterns(patterns[split], base_path=str(base))
    except FileNotFoundError as e:
        raise SnapshotError(
            f"subset {subset!r} of {folder}: its {CARD} lists {patterns[split]} for split {split!r}, and no such file "
            "is in the folder (a partial download?)"
        ) from e
    return _data_files([Path(f) for f in found], folder, f"{CARD} configs", subset)


def _split_files(folder: Path, split: str) -> list[Path]:
    """The data files of ``split`` below ``folder``, split by file and folder names as ``datasets`` splits them."""
    try:
        patterns = get_data_patterns(str(folder))
    except FileNotFoundError as e:  # datasets: "The directory at ... doesn't contain any data files"
        raise SnapshotError(f"no .jsonl / .json / .parquet files in {folder}") from e
    if split not in patterns:
        raise SnapshotError(f"{folder} has no split {split!r}; its splits (from the file names): {_names(patterns)}")
    return [Path(f) for f in DataFilesList.from_patterns(patterns[split], base_path=str(folder))]


def _data_files(candidates: list[Path], root: Path, layout: str, subset: str | None = None) -> DataFiles:
    files = sorted({p.resolve() for p in candidates if _is_data(p, root)}, key=lambda p: p.as_posix())
    if not files:
        raise SnapshotError(f"no .jsonl / .json / .parquet files in {root.absolute()}")
    kinds = {DATA_SUFFIXES[p.suffix.lower()] for p in files}
    if len(kinds) != 1:
        names = [p.name for p in files[:6]]
        raise SnapshotError(f"the data files of {root} must all be .jsonl / .json or all .parquet, got {names}")
    return DataFiles(kinds.pop(), tuple(str(p) for p in files), layout, subset)


def _is_data(path: Path, root: Path) -> bool:
    if not path.is_file() or path.suffix.lower() not in DATA_SUFFIXES:
        return False
    relative = path.relative_to(root) if path.is_relative_to(root) else Path(path.name)
    return not any(_hidden(part) for part in relative.parts)


def _hidden(name: str) -> bool:
    return name.startswith((".", "_"))


def _names(names) -> str:
    names = [str(n) for n in names]
    return ", ".join(names) if names else "none"
