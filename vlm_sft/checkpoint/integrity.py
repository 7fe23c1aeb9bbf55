"""Manifests: every file of a checkpoint folder with its size and digest, written last, checked before a resume.

The atomic rename of ``step-N.tmp`` covers a run killed mid-save, not what happens to the files afterwards (a shard
cut short, deleted, or with lost blocks at the right size). ``MANIFEST.json`` is written after every other file and
before the rename::

    {"format": 1, "algorithm": "sha256", "chunk_bytes": 67108864,
     "files": [{"path": "__0_0.distcp", "size": 9183556, "digest": "5be1..."}, ...]}

- **Digest**: ``sha256(sha256(chunk 0) + sha256(chunk 1) + ...)`` over 64 MiB chunks of the whole file (a sample would
  miss lost blocks mid-file), hashed in threads and, at resume, spread over the ranks.
- **Durable**: each rank ``fsync``s the files it hashes, rank 0 the manifest, the marker and the folders
  (``sync_files``), so the marker never vouches for bytes still in a page cache.
- **Sealed subfolders** (``hf/``, sealed by ``export.export_final``) are not hashed again: their records are taken with
  the folder's prefix and their ``MANIFEST.json`` is hashed as one more file.
- **Who hashes**: at save, each rank the files it wrote, rank 0 gathers and writes the manifest; at resume, every rank
  checks every size and hashes every ``world_size``-th chunk, and all reach one verdict.

Not covered: the manifest itself (the ``COMPLETE`` marker holds its digest) and files added later (never read).
``python -m vlm_sft.checkpoint.integrity DIR`` checks folders by hand. The costs and the choice of sha256:
docs/cluster.md, "Damaged checkpoints and failed saves".
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from vlm_sft.parallel.collectives import all_ranks_or_none, gather_objects
from vlm_sft.parallel.env import DistEnv

MANIFEST = "MANIFEST.json"
FORMAT = 1
ALGORITHM = "sha256"
"""hashlib's name for the digest new manifests use (the manifest names it; a reader uses the manifest's)."""
CHUNK_BYTES = 64 << 20
"""Bytes per hashed chunk: the unit of parallel work (64 MiB: ~50 ms of one core, a few per shard per thread)."""
_READ_BYTES = 8 << 20
"""Read buffer per thread: what hashing holds in memory at once, per thread."""
HASH_THREADS = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
"""Threads that hash chunks at once on one rank (the cores this process may use, at most 8)."""
_LOCAL = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@dataclass(frozen=True)
class FileRecord:
    """One file of a manifest."""

    path: str
    """Relative to the folder, ``/``-separated."""
    size: int
    """Bytes."""
    digest: str
    """Hex hash list of its chunks (module docstring)."""


@dataclass(frozen=True, order=True)
class Damage:
    """A file that is not as the manifest records it."""

    file: str
    """The file's path (the folder joined with its relative path)."""
    reason: str
    """What is wrong: missing, another size, other bytes, unreadable."""

    def __str__(self) -> str:
        return f"{self.file}: {self.reason}"


@dataclass(frozen=True)
class Verdict:
    """What ``verify`` found; the same on every rank."""

    folder: Path
    damage: tuple[Damage, ...]
    """Every damaged file, sorted; empty when the folder is as written (or has no manifest)."""
    has_manifest: bool
    """False: no manifest (a folder written by an older vlm-sft), so its files were not checked."""

    @property
    def ok(self) -> bool:
        return not self.damage

    def describe(self) -> str:
        """The first damaged file and why (and how many more), for a message."""
        more = f" (and {len(self.damage) - 1} more damaged file(s))" if len(self.damage) > 1 else ""
        return f"{self.damage[0]}{more}" if self.damage else f"{self.folder}: intact"


# ------------------------------------------------------------------------------------------------- digests


def chunk_count(size: int, chunk_bytes: int) -> int:
    """Chunks of a file of ``size`` bytes (an empty file has one, empty)."""
    return max(1, math.ceil(size / chunk_bytes))


def _hash_chunk(path: Path, index: int, size: int, algorithm: str, chunk_bytes: int) -> bytes:
    """The digest of chunk ``index`` of a file of ``size`` bytes; a file that ends early is an ``OSError``."""
    start = index * chunk_bytes
    left = max(0, min(chunk_bytes, size - start))
    h = hashlib.new(algorithm)
    view = memoryview(bytearray(min(_READ_BYTES, max(left, 1))))
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        while left:
            got = f.readinto(view[: min(left, len(view))])
            if not got:
                raise OSError(f"ends at byte {f.tell()}, before the {size} bytes it had when it was written")
            h.update(view[:got])
            left -= got
    return h.digest()


def _combine(chunks: Iterable[bytes], algorithm: str) -> str:
    return hashlib.new(algorithm, b"".join(chunks)).hexdigest()


def _parallel(fn: Callable, units: list) -> list:
    """``[fn(*u) for u in units]``, on ``HASH_THREADS`` threads when there is more than one unit."""
    if len(units) <= 1 or HASH_THREADS == 1:
        return [fn(*u) for u in units]
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        return list(pool.map(lambda u: fn(*u), units))


def hash_files(
    folder: Path, paths: Iterable[str], *, algorithm: str = ALGORITHM, chunk_bytes: int | None = None
) -> list[FileRecord]:
    """Records of ``paths`` (relative to ``folder``), every chunk of every file on the thread pool (``chunk_bytes``
    None: ``CHUNK_BYTES``)."""
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    sizes = {p: (folder / p).stat().st_size for p in paths}
    counts = {p: chunk_count(size, chunk_bytes) for p, size in sizes.items()}
    units = [(folder / p, i, sizes[p], algorithm, chunk_bytes) for p in sizes for i in range(counts[p])]
    digests = iter(_parallel(_hash_chunk, units))
    return [FileRecord(p, sizes[p], _combine([next(digests) for _ in range(counts[p])], algorithm)) for p in sizes]


def file_digest(path: str | os.PathLike) -> str:
    """The digest a new manifest records for the file at ``path``."""
    path = Path(path)
    return hash_files(path.parent, [path.name])[0].digest


# ------------------------------------------------------------------------------------------------- writing


def list_files(
    folder: Path, exclude: Iterable[str] = (), *, algorithm: str = ALGORITHM, chunk_bytes: int | None = None
) -> tuple[list[str], list[FileRecord]]:
    """What a manifest of ``folder`` covers: (relative paths to hash, records taken from sealed subfolders whose
    manifest hashes as this one will). The folder's own ``MANIFEST.json`` and the top-level names in ``exclude`` are
    left out."""
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    skip = {MANIFEST, *exclude}
    paths: list[str] = []
    sealed: list[FileRecord] = []
    for top, dirs, files in os.walk(folder):
        here = Path(top)
        rel = here.relative_to(folder)
        sub = here != folder and MANIFEST in files
        manifest = json.loads((here / MANIFEST).read_text(encoding="utf-8")) if sub else None
        if manifest is not None and (manifest["algorithm"], manifest["chunk_bytes"]) == (algorithm, chunk_bytes):
            prefix = rel.as_posix()  # a sealed subfolder: its manifest stands for its files
            sealed += [FileRecord(f"{prefix}/{r['path']}", r["size"], r["digest"]) for r in manifest["files"]]
            paths.append(f"{prefix}/{MANIFEST}")
            dirs.clear()
            continue
        dirs.sort()
        paths += [(rel / name).as_posix() for name in sorted(files) if here != folder or name not in skip]
    return paths, sealed


def write_manifest(
    folder: Path, env: DistEnv, *, writer: Callable[[str], int] = lambda path: 0, exclude: Iterable[str] = ()
) -> str:
    """Hash every file of ``folder`` and write its ``MANIFEST.json`` (module docstring); every rank must call this.

    ``writer(relative path)``: the rank that wrote the file, which hashes it (a rank outside the job: rank 0).
    Returns ``"<algorithm>:<hex>"`` of the manifest's own bytes on rank 0 (for the ``COMPLETE`` marker), ``""``
    elsewhere. A file no rank hashed (a rank that does not see what another wrote) fails the save on every rank."""
    algorithm, chunk_bytes = ALGORITHM, CHUNK_BYTES
    with all_ranks_or_none(env, f"hashing the files of {folder}"):
        paths, sealed = list_files(folder, exclude, algorithm=algorithm, chunk_bytes=chunk_bytes)
        owner = {p: r if 0 <= (r := writer(p)) < env.world_size else 0 for p in paths}
        own = [p for p in paths if owner[p] == env.rank]
        mine = hash_files(folder, own, algorithm=algorithm, chunk_bytes=chunk_bytes)
        sync_files(folder / p for p in own)  # on disk before the marker says complete (a crash, not only a kill)
    parts = gather_objects(mine, env)
    digest = ""
    with all_ranks_or_none(env, f"writing {folder / MANIFEST}"):
        if env.is_main:
            hashed = {r.path: r for part in parts for r in part}
            unhashed = [f"{p} (rank {owner[p]})" for p in paths if p not in hashed]
            if unhashed:
                raise RuntimeError(
                    f"{folder}: no rank hashed {unhashed[:5]}: a rank does not see the files another wrote; a "
                    "multi-node run needs train.output_dir on a filesystem every node sees"
                )
            records = sorted([*hashed.values(), *sealed], key=lambda r: r.path)
            text = json.dumps(
                {"format": FORMAT, "algorithm": algorithm, "chunk_bytes": chunk_bytes,
                 "files": [{"path": r.path, "size": r.size, "digest": r.digest} for r in records]},
                indent=1,
            ) + "\n"  # fmt: skip
            (folder / MANIFEST).write_text(text, encoding="utf-8")
            sync_files([folder / MANIFEST])
            digest = f"{algorithm}:{hashlib.new(algorithm, text.encode()).hexdigest()}"
    return digest


ASIDE_SUFFIX = ".old.tmp"
"""``replace_folder`` moves an earlier folder of the same name aside as ``<name>.old.tmp`` while the new one lands."""


def replace_folder(tmp: Path, directory: Path) -> None:
    """``tmp`` (complete and sealed) renamed to ``directory``; an earlier ``directory`` is moved aside first and
    removed after, so a crash leaves either folder whole, never a mix (rank-local: one rank calls this). When the
    rename of ``tmp`` fails, the earlier folder is moved back before the error goes on: it may be the only copy, and
    a later save's clean-up removes every ``*.tmp`` (``state._remove_stale`` also restores an orphaned one)."""
    old = directory.with_name(directory.name + ASIDE_SUFFIX)
    moved = directory.exists()
    if moved:
        shutil.rmtree(old, ignore_errors=True)
        directory.rename(old)
    try:
        tmp.rename(directory)
    except OSError:
        if moved:
            old.rename(directory)
        raise
    sync_files([directory.parent])
    shutil.rmtree(old, ignore_errors=True)


def sync_files(paths: Iterable[Path]) -> None:
    """``fsync`` each file or folder: its data (a folder: its entries, e.g. a rename) on disk, not only in the page
    cache, so a node that loses power after a save still has what the manifest and the marker promise."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ----------------------------------------------------------------------------------------------- verifying


@dataclass(frozen=True)
class _Manifest:
    algorithm: str
    chunk_bytes: int
    files: tuple[FileRecord, ...]
    text_digest: str
    """Of the manifest's bytes: the ranks check that they all read the same one."""


def _read_manifest(folder: Path, expected: str | None) -> tuple[_Manifest | None, list[Damage]]:
    """The manifest (None: there is none) and what is wrong with it; rank-local, never raises for the files."""
    path = folder / MANIFEST
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        if expected is None:
            return None, []
        return None, [Damage(str(path), "missing (the COMPLETE marker records one)")]
    except OSError as err:
        return None, [Damage(str(path), f"cannot be read ({err})")]
    if expected is not None:
        algorithm = expected.split(":", 1)[0]
        if algorithm not in hashlib.algorithms_available:
            return None, [Damage(str(path), f"its digest in the COMPLETE marker uses {algorithm!r}, unknown here")]
        if f"{algorithm}:{hashlib.new(algorithm, raw).hexdigest()}" != expected:
            return None, [Damage(str(path), "its bytes differ from the digest the COMPLETE marker records")]
    try:
        data = json.loads(raw)
        if data["format"] != FORMAT or data["algorithm"] not in hashlib.algorithms_available:
            raise ValueError(f"format {data['format']!r}, algorithm {data['algorithm']!r}")
        files = tuple(FileRecord(str(r["path"]), int(r["size"]), str(r["digest"])) for r in data["files"])
        manifest = _Manifest(data["algorithm"], int(data["chunk_bytes"]), files, hashlib.sha256(raw).hexdigest())
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
        return None, [Damage(str(path), f"not a manifest this vlm-sft reads ({type(err).__name__}: {err})")]
    return manifest, []


def _check_sizes(folder: Path, manifest: _Manifest) -> list[Damage]:
    damage = []
    for r in manifest.files:
        try:
            size = (folder / r.path).stat().st_size
        except FileNotFoundError:
            damage.append(Damage(str(folder / r.path), "missing"))
            continue
        except OSError as err:
            damage.append(Damage(str(folder / r.path), f"cannot be read ({err})"))
            continue
        if size != r.size:
            change = "truncated" if size < r.size else "grown"
            damage.append(Damage(str(folder / r.path), f"{size} bytes, but {r.size} were written ({change})"))
    return damage


def verify(folder: str | os.PathLike, env: DistEnv = _LOCAL, *, expected: str | None = None) -> Verdict:
    """Check ``folder`` against its manifest; every rank must call this, and every rank gets the same verdict.

    ``expected``: the manifest's own digest (``"<algorithm>:<hex>"``, from the ``COMPLETE`` marker), or None when the
    folder's marker names none; then a folder without a manifest (an older vlm-sft's) is a verdict with
    ``has_manifest`` False, not damage. Missing files and other sizes are found by every rank at once (a ``stat``);
    the files' bytes are hashed only when every size is right, each rank every ``world_size``-th chunk."""
    folder = Path(folder)
    manifest, damage = _read_manifest(folder, expected)
    if manifest is not None:
        damage += _check_sizes(folder, manifest)
    digests: dict[tuple[str, int], bytes] = {}
    if manifest is not None and not damage:
        units = [(r, i) for r in manifest.files for i in range(chunk_count(r.size, manifest.chunk_bytes))]
        mine = units[env.rank :: env.world_size]
        found = _parallel(
            lambda r, i: _try_chunk(folder, r, i, manifest.algorithm, manifest.chunk_bytes), mine
        )  # fmt: skip
        for (r, i), got in zip(mine, found, strict=True):
            if isinstance(got, Damage):
                damage.append(got)
            else:
                digests[(r.path, i)] = got
    seen = None if manifest is None else manifest.text_digest
    parts = gather_objects((damage, seen, digests), env)  # every rank decides on the same facts
    damage = sorted({d for part in parts for d in part[0]})
    manifests = {part[1] for part in parts}
    if len(manifests) > 1:
        damage.append(Damage(str(folder / MANIFEST), "the ranks read different bytes from it"))
    if not damage and manifest is not None:
        digests = {k: v for part in parts for k, v in part[2].items()}
        for r in manifest.files:
            chunks = [digests[(r.path, i)] for i in range(chunk_count(r.size, manifest.chunk_bytes))]
            if _combine(chunks, manifest.algorithm) != r.digest:
                damage.append(Damage(str(folder / r.path), "other bytes than were written (its digest differs)"))
    return Verdict(folder, tuple(damage), has_manifest=None not in manifests)


def _try_chunk(folder: Path, record: FileRecord, index: int, algorithm: str, chunk_bytes: int) -> bytes | Damage:
    try:
        return _hash_chunk(folder / record.path, index, record.size, algorithm, chunk_bytes)
    except OSError as err:
        return Damage(str(folder / record.path), f"cannot be read ({err})")


def main(argv: list[str] | None = None) -> int:
    """``python -m vlm_sft.checkpoint.integrity FOLDER...``: check folders against their manifests (exit 1 if any
    is damaged or has none)."""
    folders = sys.argv[1:] if argv is None else argv
    if not folders:
        print("usage: python -m vlm_sft.checkpoint.integrity FOLDER [FOLDER ...]", file=sys.stderr)
        return 2
    bad = 0
    for folder in folders:
        verdict = verify(folder)
        if not verdict.has_manifest and verdict.ok:
            print(f"{folder}: no {MANIFEST}, not checked")
            bad += 1
        elif verdict.ok:
            print(f"{folder}: intact")
        else:
            print(f"{folder}: damaged: " + "; ".join(str(d) for d in verdict.damage))
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
