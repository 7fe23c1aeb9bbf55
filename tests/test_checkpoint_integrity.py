"""Damaged checkpoints and failed saves (``checkpoint.integrity``, ``checkpoint.resume``, ``checkpoint.state``).

1. Every checkpoint holds a manifest of its files (size, digest of 64 MiB chunks, here made 1 KiB so that files span
   several); a resume checks it first. A file of the newest checkpoint truncated, deleted, or changed at its size:
   the checkpoint named by path is refused naming the file; ``latest`` falls back to the older one with a warning
   naming it and why, and a resumed tiny run's losses equal the uninterrupted run's. A checkpoint without a manifest
   (an older vlm-sft's) loads with a warning.
2. A save that fails (ENOSPC, EACCES injected into DCP's shard writes, the JSON, the RNG file, the HF export, the
   manifest, the marker) removes its ``.tmp``, keeps the earlier checkpoints and names the folder; on 2 ranks, one
   rank's failure stops both (the other with ``PeerFailure``), and both ranks check a checkpoint's files together.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
from train_helpers import Background, deterministic, launch_env, read_metrics, run_training, tiny_run_args

from vlm_sft.checkpoint import integrity, state
from vlm_sft.checkpoint.state import (
    COMPLETE_MARKER,
    CheckpointSaveError,
    TrainerState,
    capture_rng,
    complete_checkpoints,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
    verify_checkpoint,
)
from vlm_sft.config import REPO_ROOT, ConfigError
from vlm_sft.parallel.env import DistEnv
from vlm_sft.parallel.failure import mark_agreed

ENV = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
SHARD = "__0_0.distcp"


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """1 KiB chunks and 2 threads: the toy checkpoints' files span many chunks, hashed in parallel."""
    monkeypatch.setattr(integrity, "CHUNK_BYTES", 1024)
    monkeypatch.setattr(integrity, "HASH_THREADS", 2)


def _toy() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 16)).sum().backward()
    opt.step()
    return model, opt


def _fake_hf(folder: Path) -> None:
    """What the trainer's ``write_extra`` leaves: an export sealed by its own manifest (``export_final``)."""
    hf = folder / "hf"
    hf.mkdir()
    (hf / "model.safetensors").write_bytes(os.urandom(5000))
    (hf / "config.json").write_text("{}")
    integrity.write_manifest(hf, ENV)


def _save(root: Path, step: int, model, opt, keep_last: int = 3, **kw) -> Path:
    st = TrainerState(step=step, scheduler={}, data={"pos": step}, rng=capture_rng())
    return save_checkpoint(
        root, model=model, optimizer=opt, state=st, env=ENV, keep_last=keep_last, write_extra=_fake_hf, **kw
    )


@pytest.fixture
def two_saved(tmp_path) -> tuple[Path, Path]:
    model, opt = _toy()
    return _save(tmp_path, 1, model, opt), _save(tmp_path, 2, model, opt)


# ------------------------------------------------------------------------------------------------ manifests


def test_the_manifest_covers_every_file_and_its_digest_is_a_hash_list(two_saved):
    _, newest = two_saved
    manifest = json.loads((newest / integrity.MANIFEST).read_text())
    on_disk = sorted(p.relative_to(newest).as_posix() for p in newest.rglob("*") if p.is_file())
    assert sorted(r["path"] for r in manifest["files"]) == [
        p for p in on_disk if p not in (integrity.MANIFEST, COMPLETE_MARKER)
    ]
    assert "hf/model.safetensors" in on_disk and "hf/MANIFEST.json" in on_disk and SHARD in on_disk
    record = next(r for r in manifest["files"] if r["path"] == SHARD)
    data = (newest / SHARD).read_bytes()
    chunks = [hashlib.sha256(data[i : i + 1024]).digest() for i in range(0, len(data), 1024)]
    assert len(chunks) > 2 and record["size"] == len(data)
    assert record["digest"] == hashlib.sha256(b"".join(chunks)).hexdigest() == integrity.file_digest(newest / SHARD)
    marker = (newest / COMPLETE_MARKER).read_text()  # the marker records the manifest's own digest
    digest = hashlib.sha256((newest / integrity.MANIFEST).read_bytes()).hexdigest()
    assert f"manifest MANIFEST.json sha256:{digest}" in marker
    assert verify_checkpoint(newest).ok and verify_checkpoint(newest).has_manifest


def test_every_file_the_marker_vouches_for_is_on_disk_before_the_rename(tmp_path, monkeypatch):
    """Each file of a checkpoint (the sealed ``hf/`` included), its manifest, its marker and the folder are
    ``fsync``ed, and the parent after the rename: a node that loses power after the save does not leave a folder
    the marker calls complete with its blocks still in the page cache. Without the syncs nothing is recorded."""
    synced: list[str] = []
    real = os.fsync

    def recording(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    model, opt = _toy()
    final = _save(tmp_path, 1, model, opt)
    on_disk = {str(p).replace(str(final), "") for p in final.rglob("*") if p.is_file()}
    written = {p.replace(str(final.with_name(final.name + ".tmp")), "") for p in synced}
    assert on_disk <= written, on_disk - written
    assert str(final.with_name(final.name + ".tmp")) in synced and str(tmp_path / "checkpoints") in synced


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _flip(path: Path) -> None:
    """Other bytes at the same size, in the middle of the file (a block lost in a crash)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "shard truncated": (SHARD, _truncate, "truncated"),
    "shard deleted": (SHARD, Path.unlink, "missing"),
    "shard changed": (SHARD, _flip, "other bytes"),
    "rng deleted": ("rng-rank00000.safetensors", Path.unlink, "missing"),
    "trainer state truncated": ("trainer_state.json", _truncate, "truncated"),
    "dcp metadata changed": (".metadata", _flip, "other bytes"),
    "hf weights truncated": ("hf/model.safetensors", _truncate, "truncated"),
    "hf manifest deleted": ("hf/MANIFEST.json", Path.unlink, "missing"),
    "manifest truncated": (integrity.MANIFEST, _truncate, "differ from the digest"),
    "manifest deleted": (integrity.MANIFEST, Path.unlink, "missing"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_checkpoint_is_refused_by_name_and_latest_falls_back(two_saved, case, caplog):
    older, newest = two_saved
    name, damage, why = DAMAGE[case]
    damage(newest / name)
    with pytest.raises(ConfigError, match=rf"damaged checkpoint: {newest / name}: .*{why}.* or set train.resume"):
        resolve_resume(str(newest), newest.parents[1])
    with caplog.at_level(logging.WARNING):
        assert resolve_resume("latest", newest.parents[1]) == older
    assert f"skipping the damaged checkpoint {newest}" in caplog.text and str(newest / name) in caplog.text
    assert why in caplog.text


def test_latest_sets_damaged_checkpoints_aside_so_keep_last_counts_intact_ones(two_saved, caplog):
    """Step 2 damaged, ``latest`` resumes from step 1 and renames step 2 to ``step-000002.damaged`` (its files kept).
    The resumed run then saves step 3 with keep_last 2: step 1 stays beside it (left as a checkpoint, the damaged
    step 2 would be counted as the newer one and the intact step 1 deleted)."""
    older, newest = two_saved
    _truncate(newest / SHARD)
    with caplog.at_level(logging.WARNING):
        assert resolve_resume("latest", newest.parents[1]) == older
    aside = newest.with_name(newest.name + ".damaged")
    assert not newest.exists() and (aside / SHARD).is_file() and f"aside as {aside}" in caplog.text
    model, opt = _toy()
    third = _save(newest.parents[1], 3, model, opt, keep_last=2)
    assert complete_checkpoints(newest.parents[1]) == [older, third]
    assert aside.is_dir()


def test_a_lost_marker_is_reported_and_every_damaged_checkpoint_is_an_error(two_saved, caplog):
    older, newest = two_saved
    (newest / COMPLETE_MARKER).unlink()  # written before the rename: a step folder without it lost it since
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        resolve_resume(str(newest), newest.parents[1])
    with caplog.at_level(logging.WARNING):
        assert resolve_resume("latest", newest.parents[1]) == older
    assert f"{newest / COMPLETE_MARKER}: missing" in caplog.text
    _truncate(older / SHARD)
    with pytest.raises(ConfigError, match="no intact checkpoint"):  # not a silent fresh start
        resolve_resume("latest", newest.parents[1])


def test_a_checkpoint_without_a_manifest_loads_with_a_warning(two_saved, caplog):
    _, newest = two_saved
    (newest / integrity.MANIFEST).unlink()
    (newest / COMPLETE_MARKER).write_text("step 2, world size 1\n")  # what an older vlm-sft wrote
    with caplog.at_level(logging.WARNING):
        assert resolve_resume(str(newest), newest.parents[1]) == newest
        assert resolve_resume("latest", newest.parents[1]) == newest
    assert caplog.text.count("has no MANIFEST.json (written by an older vlm-sft)") == 2
    model, opt = _toy()
    assert load_checkpoint(newest, model=model, optimizer=opt, env=ENV).data == {"pos": 2}


# ------------------------------------------------------------------------------------------------ failed saves


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class _FullDisk:
    """A DCP stream that writes some bytes, then finds the disk full."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def write(self, data) -> int:
        self.stream.write(bytes(data)[:100])
        _no_space()

    def __getattr__(self, name):
        return getattr(self.stream, name)


def _inject(monkeypatch, where: str) -> None:
    if where == "dcp shard":
        real = dcp_filesystem.FileSystem.create_stream

        @contextmanager
        def create_stream(self, path, mode):
            with real(self, path, mode) as stream:
                yield _FullDisk(stream) if str(path).endswith(".distcp") else stream

        monkeypatch.setattr(dcp_filesystem.FileSystem, "create_stream", create_stream)
    elif where == "rng file":
        monkeypatch.setattr(state, "write_rng", _no_space)
    elif where == "hf export":
        monkeypatch.setattr(integrity, "write_manifest", _denied_for("hf", integrity.write_manifest))
    else:  # trainer state, manifest, marker: Path.write_text
        real = Path.write_text

        def write_text(self, *args, **kwargs):
            if self.name == where:
                _no_space()
            return real(self, *args, **kwargs)

        monkeypatch.setattr(Path, "write_text", write_text)


def _denied_for(folder: str, real):
    def write_manifest(path, *args, **kwargs):
        if path.name == folder:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real(path, *args, **kwargs)

    return write_manifest


@pytest.mark.parametrize(
    "where", ["dcp shard", "trainer_state.json", "rng file", "hf export", integrity.MANIFEST, COMPLETE_MARKER]
)
def test_a_failed_save_removes_its_folder_and_keeps_the_earlier_ones(two_saved, where, monkeypatch):
    older, newest = two_saved
    model, opt = _toy()
    _inject(monkeypatch, where)
    tmp = newest.parent / "step-000003.tmp"
    reason = "Permission denied" if where == "hf export" else "No space left on device"
    with pytest.raises(CheckpointSaveError, match=rf"step 3 into {tmp}: .*{reason}.*kept \(step-000001, step-000002\)"):
        _save(newest.parents[1], 3, model, opt)
    assert sorted(p.name for p in newest.parent.iterdir()) == ["step-000001", "step-000002"]
    assert verify_checkpoint(older).ok and verify_checkpoint(newest).ok
    monkeypatch.undo()  # the disk has room again: the next save works
    assert _save(newest.parents[1], 3, model, opt) in complete_checkpoints(newest.parents[1])


# ------------------------------------------------------------------------------------------------ two ranks

TWO_RANKS = r"""
import errno, json, os, sys
from pathlib import Path
import torch
from vlm_sft.checkpoint import integrity, state
from vlm_sft.parallel.collectives import PeerFailure, all_ranks_or_none
from vlm_sft.parallel.env import cleanup, end_process, init_distributed

integrity.CHUNK_BYTES = 1024  # the shards span many chunks, so both ranks hash some of each
env = init_distributed("cpu")
root = Path(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Linear(64, 64)
opt = torch.optim.AdamW(model.parameters())
model(torch.ones(1, 64)).sum().backward()
opt.step()
def save(step):
    st = state.TrainerState(step=step, scheduler={}, data={"pos": step}, rng=state.capture_rng())
    return state.save_checkpoint(root, model=model, optimizer=opt, state=st, env=env, keep_last=3)
older, newest = save(1), save(2)
out = {"files": sorted(r["path"] for r in json.loads((newest / "MANIFEST.json").read_text())["files"])}
with all_ranks_or_none(env, "damaging"):
    if env.rank == 0:  # one byte of rank 1's file, at its size: one rank hashes that chunk, both must refuse it
        damaged = bytearray((newest / "rng-rank00001.safetensors").read_bytes())
        damaged[len(damaged) // 2] ^= 0xFF
        (newest / "rng-rank00001.safetensors").write_bytes(bytes(damaged))
out["latest"] = state.resolve_resume("latest", root, env=env).name
if env.rank == 1:
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    state.write_rng = no_space
try:
    save(3)
except (state.CheckpointSaveError, PeerFailure) as err:
    out["error"] = f"{type(err).__name__}: {err}"
with all_ranks_or_none(env, "waiting for rank 0's clean-up"):
    pass
out["left"] = sorted(p.name for p in (root / "checkpoints").iterdir())
(root / f"rank{env.rank}.json").write_text(json.dumps(out))
cleanup(env, finished=True)
end_process(0)  # as the CLI ends a process of a multi-process run (parallel.env)
"""


def test_two_ranks_check_together_and_a_failed_save_stops_both(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in (0, 1):
        env = launch_env() | {
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        }  # fmt: skip
        cmd = [sys.executable, "-c", TWO_RANKS, str(tmp_path)]
        procs.append(subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e.decode()[-3000:] for _, e in outputs]
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert {"data-rank00001.json", "rng-rank00001.safetensors", "data-rank00000.json"} <= set(rank0["files"])
    assert rank0["latest"] == rank1["latest"] == "step-000001"  # step 2's rank-1 file was changed: both skip it
    tmp = tmp_path / "checkpoints" / "step-000003.tmp"
    assert rank1["error"].startswith(f"CheckpointSaveError: could not save the checkpoint of step 3 into {tmp}")
    assert "No space left on device" in rank1["error"]
    assert rank0["error"] == f"PeerFailure: stopped: rank 1 failed while writing the trainer state into {tmp} " + (
        "(its error is printed by that rank)"
    )
    assert rank0["left"] == rank1["left"] == ["step-000001", "step-000002.damaged"]  # set aside by latest


# ------------------------------------------------------------------------------------------------ a real run


def test_a_run_resumes_from_the_newest_intact_checkpoint_as_if_uninterrupted(tmp_path, capsys):
    """Four steps saved after steps 1-3; step 3's shard cut in half (the reported failure), a file of step 2 deleted.
    Named, each is refused (exit 2, naming the file); ``latest`` resumes from step 1 with a warning for each, and the
    losses of steps 2-4 equal the uninterrupted run's."""
    args = tiny_run_args(tmp_path, **{"train.max_steps": 4, "train.save_every": 1, "train.keep_last": 3})
    reference = Background(args)
    import vlm_sft.trainer.loop  # noqa: F401 (imported while the reference trains: main's first call is then quick)
    from vlm_sft.train import main

    reference.wait()
    run = tmp_path / "run"
    expected = deterministic(read_metrics(run))
    steps = run / "checkpoints"
    assert integrity.verify(run / "final").has_manifest and integrity.verify(run / "final").ok
    assert not any(p.name.endswith(".tmp") for p in run.iterdir())
    _truncate(steps / "step-000003" / SHARD)
    (steps / "step-000002" / "rng-rank00000.safetensors").unlink()
    for step, file, why in [(3, SHARD, "truncated"), (2, "rng-rank00000.safetensors", "missing")]:
        assert main([*args, "--train.resume", str(steps / f"step-00000{step}")]) == 2
        err = capsys.readouterr().err
        assert f"damaged checkpoint: {steps / f'step-00000{step}' / file}: " in err and why in err, err
    final = (run / "final").stat().st_ino
    resumed = run_training([*args, "--train.resume", "latest"])
    assert resumed.stderr.count("skipping the damaged checkpoint") == 2, resumed.stderr[-3000:]
    assert str(steps / "step-000003" / SHARD) in resumed.stderr
    assert f"resuming from {steps / 'step-000001'}, the newest intact checkpoint" in resumed.stderr
    assert deterministic(read_metrics(run)) == expected
    assert all(verify_checkpoint(p).ok for p in complete_checkpoints(run)) and integrity.verify(run / "final").ok
    assert (run / "final").stat().st_ino != final  # replaced by the resumed run's export, by a rename
    assert sorted(p.name for p in run.iterdir() if "final" in p.name) == ["final"]


def test_the_final_export_is_sealed_and_a_failed_one_keeps_the_earlier(tmp_path, monkeypatch):
    from vlm_sft.checkpoint import export

    final = tmp_path / "final"

    def write(directory, *args, **kwargs):
        directory.mkdir(parents=True)
        (directory / "model.safetensors").write_bytes(os.urandom(3000))

    def write_then_fill_the_disk(directory, *args, **kwargs):
        write(directory)
        _no_space()

    monkeypatch.setattr(export, "_write_final", write)
    assert export.export_final(final, None, None, ENV, None) == final
    before = (final / integrity.MANIFEST).read_bytes()
    assert integrity.verify(final).has_manifest and integrity.verify(final).ok
    monkeypatch.setattr(export, "_write_final", write_then_fill_the_disk)
    with pytest.raises(CheckpointSaveError, match=rf"HF export {final} \(into {final}.tmp, now removed\): .*No space"):
        export.export_final(final, None, None, ENV, None)
    assert [p.name for p in tmp_path.iterdir()] == ["final"] and (final / integrity.MANIFEST).read_bytes() == before


# ------------------------------------------------------------------------ saves that fail on one rank (issue 44)


def test_a_save_interrupted_on_rank_0_alone_leaves_its_folder_to_the_peers_still_writing(two_saved, monkeypatch):
    """Ctrl-C on rank 0 alone: the other ranks may still write into ``step-N.tmp``, so rank 0 must not delete it
    (the next save does); an error every rank agreed on, or a one-process run, removes it at once."""
    _, newest = two_saved
    root = newest.parents[1]
    tmp = newest.parent / "step-000003.tmp"
    model, opt = _toy()
    raised: list[BaseException] = [KeyboardInterrupt()]

    def interrupted(tmp, *args):
        tmp.mkdir(exist_ok=True)
        (tmp / "__1_0.distcp").write_bytes(b"rank 1 is still writing this")
        raise raised[0]

    monkeypatch.setattr(state, "_write_checkpoint", interrupted)
    st = TrainerState(step=3, scheduler={}, data={}, rng=capture_rng())
    two = DistEnv(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(root, model=model, optimizer=opt, state=st, env=two, keep_last=3)
    assert (tmp / "__1_0.distcp").is_file()
    raised[0] = OSError(errno.EIO, "rank 0's own disk error, between two collectives")
    with pytest.raises(CheckpointSaveError, match=r"Left step-000003\.tmp \(the next save removes it\)"):
        save_checkpoint(root, model=model, optimizer=opt, state=st, env=two, keep_last=3)
    assert tmp.is_dir()
    raised[0] = OSError(errno.ENOSPC, "full")
    mark_agreed(raised[0])  # out of an agreement: every rank stopped there
    with pytest.raises(CheckpointSaveError, match=r"Removed step-000003\.tmp"):
        save_checkpoint(root, model=model, optimizer=opt, state=st, env=two, keep_last=3)
    assert not tmp.exists()
    raised[0] = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):  # one process: nobody else writes there
        save_checkpoint(root, model=model, optimizer=opt, state=st, env=ENV, keep_last=3)
    assert not tmp.exists()


def test_a_replacement_that_fails_to_land_keeps_the_earlier_checkpoint(two_saved, monkeypatch):
    """A re-save of step 2 whose final rename fails: the step 2 moved aside is put back, and the next save's clean-up
    of ``*.tmp`` folders never deletes it (an orphaned ``step-N.old.tmp`` is renamed back)."""
    _, newest = two_saved
    root = newest.parents[1]
    model, opt = _toy()
    real = Path.rename

    def rename(self, target):
        if self.name == "step-000002.tmp":
            raise OSError(errno.EXDEV, "the rename failed")
        return real(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(CheckpointSaveError, match="the rename failed"):
        _save(root, 2, model, opt)
    monkeypatch.undo()
    assert verify_checkpoint(newest).ok and not list(newest.parent.glob("*.tmp"))
    newest.rename(newest.with_name("step-000002.old.tmp"))  # as if putting it back had failed too
    _save(root, 3, model, opt)
    assert [p.name for p in complete_checkpoints(root)] == ["step-000001", "step-000002", "step-000003"]
    assert verify_checkpoint(newest).ok


def test_each_data_file_is_read_once_per_resume_not_once_per_rank(tmp_path, monkeypatch):
    """A checkpoint of 3 ranks resumed on 2: each rank opens every 2nd data file (the parts are gathered), where every
    rank opened all of them (a 256-rank job: 65,536 opens on the shared filesystem)."""
    from vlm_sft.parallel import collectives

    for r in range(3):
        (tmp_path / state.data_file(r)).write_text(json.dumps({"format": 1, "streams": {str(r): {"at": r}}}))
        state.write_rng(tmp_path / state.rng_file(r), capture_rng())
    main = {"format": 1, "step": 4, "world_size": 3, "scheduler": {}, "param_groups": [], "extra": {}}
    (tmp_path / state.TRAINER_STATE).write_text(json.dumps(main))
    opened: dict[int, list[str]] = {0: [], 1: []}
    reading = [0]
    real = state._read_json
    monkeypatch.setattr(collectives, "all_reduce_sum", lambda value, env: value)  # one rank at a time, no group

    def read_json(path):
        if path.name.startswith("data-rank"):
            opened[reading[0]].append(path.name)
        return real(path)

    def gather(obj, env):  # this rank's share, and the other rank's as it would read it
        other = {q: json.loads((tmp_path / state.data_file(q)).read_text()) for q in range(1 - env.rank, 3, 2)}
        return [obj, other] if env.rank == 0 else [other, obj]

    monkeypatch.setattr(state, "_read_json", read_json)
    monkeypatch.setattr(state, "gather_objects", gather, raising=False)
    for rank in (1, 0):
        reading[0] = rank
        env = DistEnv(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"))
        data = state.read_trainer_state(tmp_path, env=env).data
    assert opened == {0: ["data-rank00000.json", "data-rank00002.json"], 1: ["data-rank00001.json"]}
    assert data["streams"] == {"0": {"at": 0}, "1": {"at": 1}, "2": {"at": 2}}


def test_a_metadata_class_this_torch_does_not_list_is_refused_naming_it_and_the_versions(two_saved, monkeypatch):
    """A class that a later torch moves would make a valid checkpoint unreadable: the message says which class, which
    torch versions, and the fix."""
    from vlm_sft.parallel import dcp

    _, newest = two_saved
    moved = ("torch.distributed.checkpoint.metadata", "Metadata")
    monkeypatch.setattr(dcp, "_METADATA_CLASSES", dcp._METADATA_CLASSES - {moved})
    with pytest.raises(dcp.UnknownMetadataClass) as info:
        dcp.check_metadata(newest)
    message = str(info.value)
    assert f"{newest / '.metadata'} refers to torch.distributed.checkpoint.metadata.Metadata" in message
    assert f"listed for torch {dcp.LISTED_FOR}; this is torch {torch.__version__}" in message
    assert "_METADATA_CLASSES in vlm_sft/parallel/dcp.py" in message
