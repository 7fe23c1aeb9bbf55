"""The same seed and config train on the same data in the same order whatever the number of data workers: the
packed batches the trainer's own path builds (``data_build.TrainPipelines`` -> ``TrainBatches``, as ``trainer.setup.setup`` does
it, on the shapes data through the tiny processor) are identical, tensor for tensor, with 0, 1 and 2 workers.

``data.num_workers`` defaults to the machine's spare cores, so a data order that depended on it would train the same
seed and config on other data on a 2-core laptop and an 8-core server. The control shows the check can fail: the
usual recipe for an ``IterableDataset`` under several workers, each worker reading its own shard of the data, does
change the order, and the comparison sees it.
"""

from __future__ import annotations

import functools

import pytest
from batch_helpers import batch_differences, rank0_batches
from torch.utils.data import get_worker_info

from vlm_sft.config import RunConfig, load_config
from vlm_sft.data import build as data_build
from vlm_sft.trainer import batches as batches_module

BATCHES = 6
"""Micro-batches compared per run: several turns of every worker and stream."""


@pytest.fixture(scope="module")
def shapes_root(tmp_path_factory):
    return tmp_path_factory.mktemp("shapes")


@functools.cache
def _data_parts(cfg_json: str) -> tuple:
    """Processor, renderer and training rows of a config (built once per config: only the batches are compared)."""
    cfg = RunConfig.model_validate_json(cfg_json)
    processor = data_build.build_processor(cfg)
    return processor, data_build.build_renderer(cfg, processor), data_build.load_sources(cfg).train


def _config(root, **overrides: object):
    """The default config on a small shapes set in short packs (a few samples each), so that a pack comes quickly."""
    base = {
        "data.shapes.root": root,
        "data.shapes.num_train": 160,
        "data.shapes.num_eval": 0,
        "data.pack_len": 320,
        "data.seq_len": 128,
        "data.bfd_buffer": 24,
        **overrides,
    }
    return load_config(None, [a for k, v in base.items() for a in (f"--{k}", str(v))])


def _batches(cfg, num_workers: int) -> list[dict]:
    """The first ``BATCHES`` micro-batches of rank 0 of one process, as ``trainer.setup.setup`` builds its ``TrainBatches``."""
    processor, renderer, rows = _data_parts(cfg.model_dump_json())
    return rank0_batches(cfg, processor, renderer, rows, num_workers=num_workers, count=BATCHES)


# data.streams_per_micro_batch x train.micro_batches: the default run's one stream (where every worker count comes
# down to one worker), and 2 x 2 = 4 streams per rank, which 2 workers really share.
LAYOUTS = [{}, {"data.streams_per_micro_batch": 2, "train.micro_batches": 2}]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["default", "4-streams"])
def test_same_batches_in_the_same_order_with_0_1_2_workers(shapes_root, layout):
    cfg = _config(shapes_root, **layout)
    reference = _batches(cfg, 0)
    assert len(reference) == BATCHES and len({b["sample_indices"] for b in reference}) == BATCHES
    for workers in (1, 2):
        assert batch_differences(_batches(cfg, workers), reference) == [], workers


def test_the_check_sees_a_worker_dependent_order_and_the_seed(shapes_root, monkeypatch):
    cfg = _config(shapes_root, **LAYOUTS[1])
    reference = _batches(cfg, 0)
    other_seed = _batches(_config(shapes_root, **LAYOUTS[1], **{"train.seed": 1}), 0)
    assert batch_differences(other_seed, reference)  # the seed is part of the data order

    def per_worker_shard(self, stream):  # each worker reads its own shard of its streams: the usual recipe
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return self.make_pipeline(stream * workers + worker, self.layout.num_streams * workers)

    monkeypatch.setattr(batches_module._StreamBatches, "_open", per_worker_shard)
    assert batch_differences(_batches(cfg, 1), reference) == []  # one worker reads what the training process reads
    assert batch_differences(_batches(cfg, 2), reference)  # two: other data
