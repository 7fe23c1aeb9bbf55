"""Eval scores chunk by chunk: hand-worked loss and accuracy, parity with full logits, peak memory within the chunked
training loss's budget at Qwen3.5's vocabulary, and ranks without eval data that still match their peers' forwards
and collectives.

Most tests use ``LMHeadStub``: an LM head over a fixed per-token hidden state with ``Qwen3_5VLM.forward``'s contract
(full logits without targets, ``TokenScores`` with ``scores=True``), running the real loss ops, so the numbers can be
worked out by hand and an eval that asked for full logits would show up in the memory test.

``python tests/test_evaluate.py --memory-child TOKENS HIDDEN CHUNK`` is the memory test's child process.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vlm_sft.data.batch import PackedBatch
from vlm_sft.model.loss import TokenScores, chunked_cross_entropy, token_scores
from vlm_sft.parallel.env import DistEnv
from vlm_sft.trainer import evaluate as evaluate_module
from vlm_sft.trainer.evaluate import evaluate
from vlm_sft.trainer.scoring import filler_batch, score_batch

QWEN3_5_VOCAB = 248_320
CPU = torch.device("cpu")
ONE_RANK = DistEnv(rank=0, world_size=1, local_rank=0, device=CPU)


class LMHeadStub(nn.Module):
    """``lm_head(embed(input_ids))`` with ``Qwen3_5VLM.forward``'s keyword contract (``position_ids`` required)."""

    def __init__(self, embed_VD: torch.Tensor, head_VD: torch.Tensor, chunk_size: int = 1024) -> None:
        super().__init__()
        self.embed = nn.Parameter(embed_VD, requires_grad=False)  # shares storage: no copy
        self.head = nn.Parameter(head_VD, requires_grad=False)
        self.chunk_size = chunk_size
        self.forwards: list[tuple[int, int, int]] = []
        """(rows, row length, trainable tokens) of every forward."""

    def forward(self, input_ids, *, position_ids, seq_lens=None, target_ids=None, loss_mask=None, scores=False, **_):
        B, L = input_ids.shape
        assert tuple(position_ids.shape) == (3, B, L)
        assert seq_lens is None or sum(seq_lens) == B * L
        self.forwards.append((B, L, -1 if loss_mask is None else int(loss_mask.sum())))
        hidden_TD = self.embed[input_ids.reshape(-1)]
        if target_ids is None:
            return (hidden_TD @ self.head.T).view(B, L, -1)
        assert scores, "eval scores tokens; the loss-sum mode is the trainer's"
        nll, argmax = token_scores(
            hidden_TD, self.head, target_ids.reshape(-1), loss_mask.reshape(-1), chunk_size=self.chunk_size
        )
        return TokenScores(nll=nll.view(B, L), argmax=argmax.view(B, L))


def packed_batch(rows: list[list[tuple[int | None, list[int], list[int], list[int]]]]) -> PackedBatch:
    """A text-only packed batch from ``(dataset index or None for padding, inputs, targets, loss mask)`` segments."""
    inputs, targets, masks, positions, lengths, indices = [], [], [], [], [], []
    for row in rows:
        for _, ids, tgt, mask in row:
            inputs += ids
            targets += tgt
            masks += mask
            positions += range(len(ids))
            lengths.append(len(ids))
        indices.append(tuple(index for index, *_ in row if index is not None))
    B = len(rows)
    batch = PackedBatch(
        input_ids=torch.tensor(inputs).view(B, -1),
        target_ids=torch.tensor(targets).view(B, -1),
        loss_mask=torch.tensor(masks, dtype=torch.bool).view(B, -1),
        position_ids=torch.tensor(positions).view(1, B, -1).expand(3, B, -1).clone(),
        seq_lens=torch.tensor(lengths),
        pixel_values=None,
        image_grid_thw=None,
        mm_token_type_ids=torch.zeros(B, len(inputs) // B, dtype=torch.long),
        num_trainable_tokens=sum(masks),
        num_real_tokens=sum(len(ids) for row in rows for index, ids, *_ in row if index is not None),
        sample_indices=tuple(indices),
    )
    batch.check()
    return batch


# Vocabulary {0, 1, 2}; hidden = one-hot(input), lm_head = identity, so the logits at a position are one-hot(input):
# argmax = the input token, and nll(target t | input x) = logsumexp(1, 0, 0) - [t == x] = ln(e + 2) - [t == x].
HAND_SAMPLES = [
    [  # row 0: A, B, then one padding token
        (10, [1, 1, 2], [1, 2, 2], [0, 1, 1]),  # A: x=1,t=2 wrong (ln(e+2)); x=2,t=2 right: not answered
        (11, [2, 2], [2, 2], [1, 1]),  # B: two right (ln(e+2) - 1 each): answered
        (None, [0], [0], [0]),
    ],
    [  # row 1: C, D, no padding
        (12, [1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [0, 1, 1, 0, 1]),  # C: three right; the wrong x=1,t=0 is masked
        (13, [2], [2], [0]),  # D: nothing trainable: not counted anywhere
    ],
]
HAND_TASKS = {10: "colour", 11: "shape", 12: "colour", 13: "count"}
# 7 trainable tokens, 6 of them right: loss sum = 7 ln(e + 2) - 6 = 4.8601129975243555; per token ln(e + 2) - 6/7.
HAND_EVAL_LOSS = 0.6943018567891938
HAND_ACCURACY = {"eval_acc_colour": 0.5, "eval_acc_shape": 1.0, "eval_acc_all": 2 / 3}  # A wrong; B, C right


def hand_stub() -> LMHeadStub:
    return LMHeadStub(torch.eye(3), torch.eye(3), chunk_size=5)  # 5 divides neither row length nor B * L = 12


def test_eval_loss_and_accuracy_match_the_hand_worked_case():
    model = hand_stub().train()
    out = evaluate(model, [packed_batch(HAND_SAMPLES)], env=ONE_RANK, sample_tasks=HAND_TASKS)
    assert out.keys() == {"eval_loss", "eval_tokens", *HAND_ACCURACY}  # no eval_acc_count: D had nothing to score
    assert out["eval_tokens"] == 7
    assert out["eval_loss"] == pytest.approx(HAND_EVAL_LOSS, abs=1e-6)
    for key, value in HAND_ACCURACY.items():
        assert out[key] == pytest.approx(value, abs=1e-6), key
    assert model.forwards == [(2, 6, 7)] and model.training  # one forward; training mode restored


def test_batches_add_up_by_tokens():
    """Two batches: the loss is the token-weighted mean (not a mean of batch means), the counts add."""
    one = packed_batch(HAND_SAMPLES[1:])  # C and D: 3 tokens at ln(e + 2) - 1
    out = evaluate(hand_stub(), [packed_batch(HAND_SAMPLES), one], env=ONE_RANK, sample_tasks=HAND_TASKS)
    assert out["eval_tokens"] == 10
    assert out["eval_loss"] == pytest.approx(0.6514447139320508, abs=1e-6)  # 10 tokens, 9 right: ln(e + 2) - 9/10
    assert out["eval_acc_colour"] == pytest.approx(2 / 3) and out["eval_acc_all"] == pytest.approx(3 / 4)


def test_score_batch_reports_each_sample():
    scored = score_batch(hand_stub(), packed_batch(HAND_SAMPLES), CPU)
    assert [(s.index, s.row, s.start, s.end, s.answered) for s in scored.samples] == [
        (10, 0, 0, 3, False),
        (11, 0, 3, 5, True),
        (12, 1, 0, 5, True),
    ]
    assert scored.argmax.tolist() == packed_batch(HAND_SAMPLES).input_ids.tolist()
    right = math.log(math.e + 2) - 1
    assert scored.nll[1].tolist() == pytest.approx([0, right, right, 0, right, 0], abs=1e-6)  # C, then D


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000])
def test_token_scores_equal_full_logits(chunk_size):
    """Per-token loss and argmax against ``F.cross_entropy`` / ``argmax`` over full fp32 logits; chunk sizes that do
    not divide T; masked positions hold 0 whatever their target."""
    T, D, V = 150, 32, 500
    hidden, weight = torch.randn(T, D), 0.3 * torch.randn(V, D)
    targets = torch.randint(0, V, (T,))
    mask = torch.rand(T) > 0.3
    targets[~mask] = V + 7  # out of range under the mask: must be ignored, never indexed
    nll, argmax = token_scores(hidden, weight, targets, mask, chunk_size=chunk_size)
    logits = hidden @ weight.T
    want = F.cross_entropy(logits, targets.masked_fill(~mask, -100), reduction="none")  # 0 at ignored positions
    assert nll.dtype == torch.float32 and argmax.dtype == torch.int64
    torch.testing.assert_close(nll, want, rtol=0, atol=1e-5)
    assert bool((nll[~mask] == 0).all()) and bool((nll[mask] > 0).all())
    assert torch.equal(argmax, logits.argmax(-1))


def test_eval_of_the_real_model_equals_scoring_over_full_logits():
    """The tiny model with images, packed rows: per-token loss, argmax, answered samples and eval loss equal what
    full logits give (the old eval's computation, here as the reference)."""
    from vlm_sft.data.collate import collate
    from vlm_sft.data.pack import Pack
    from vlm_sft.data.shift import shift_sample
    from vlm_sft.data.synthetic import SyntheticSource
    from vlm_sft.model import build_model, tiny_qwen3_5_config

    model = build_model(tiny_qwen3_5_config()).eval()
    source = SyntheticSource(6, distribution="short")
    s = [shift_sample(source(i)) for i in range(6)]
    batch = collate([Pack(rows=((s[0], s[1]),), row_len=140), Pack(rows=((s[2], s[3], s[4]),), row_len=140)])
    assert batch.num_images > 0
    scored = score_batch(model, batch, CPU)
    with torch.no_grad():
        kwargs = {k: v for k, v in batch.model_kwargs().items() if k not in ("target_ids", "loss_mask")}
        logits = model(**kwargs).float()
    mask = batch.loss_mask
    want = F.cross_entropy(logits.flatten(0, 1), batch.target_ids.flatten(), reduction="none").view(mask.shape)
    torch.testing.assert_close(scored.nll[mask], want[mask], rtol=0, atol=1e-5)
    assert bool((scored.nll[~mask] == 0).all())
    assert torch.equal(scored.argmax, logits.argmax(-1))
    hit = (logits.argmax(-1) == batch.target_ids) | ~mask
    want_samples = [
        (i, r, bool(hit[r, a:b].all())) for r in (0, 1) for a, b, i in batch.row_segments(r) if i is not None
    ]
    assert [(x.index, x.row, x.answered) for x in scored.samples] == want_samples
    out = evaluate(model, [batch], env=ONE_RANK)
    assert out["eval_tokens"] == int(mask.sum())
    assert out["eval_loss"] == pytest.approx(float(want[mask].sum()) / int(mask.sum()), rel=1e-5)


# ---------------------------------------------------------------------------------------- ranks without eval data


class FakeGroup:
    """All-reduce between threads that each play a rank; a rank that skips a collective breaks the barrier."""

    def __init__(self, world_size: int) -> None:
        self.barrier = threading.Barrier(world_size, timeout=30)
        self.slots: list[torch.Tensor | None] = [None] * world_size
        self.calls: list[list[tuple[str, tuple[int, ...]]]] = [[] for _ in range(world_size)]

    def all_reduce(self, value: torch.Tensor, env: DistEnv, op: str = "sum") -> torch.Tensor:
        assert value.device.type == "cpu", "the trainer's collectives take host tensors"
        self.calls[env.rank].append((op, tuple(value.shape)))
        self.slots[env.rank] = value.clone()
        self.barrier.wait()
        stacked = torch.stack(self.slots)
        out = {"sum": stacked.sum(0), "max": stacked.amax(0), "min": stacked.amin(0)}[op]
        self.barrier.wait()  # every rank has read the slots before any rank writes its next value
        return out


def test_a_rank_without_eval_batches_runs_filler_forwards(monkeypatch):
    """Rank 0 has two batches, rank 1 none: both run two forwards and issue the same collectives, rank 1's filler
    forwards add nothing, and both ranks report rank 0's hand-worked figures (with one batch counted twice)."""
    group = FakeGroup(2)
    monkeypatch.setattr(evaluate_module, "all_reduce", group.all_reduce)
    models = [hand_stub(), hand_stub()]
    shares = [[packed_batch(HAND_SAMPLES), packed_batch(HAND_SAMPLES)], []]

    def rank(r: int) -> dict:
        env = DistEnv(rank=r, world_size=2, local_rank=r, device=CPU)
        return evaluate(models[r], shares[r], env=env, sample_tasks=HAND_TASKS)

    with ThreadPoolExecutor(2) as pool:
        results = [f.result(timeout=60) for f in [pool.submit(rank, r) for r in (0, 1)]]
    assert group.calls[0] == group.calls[1]
    assert len(models[1].forwards) == len(models[0].forwards) == 2
    assert all(trainable == 0 for _, _, trainable in models[1].forwards)
    for out in results:
        assert out["eval_tokens"] == 14
        assert out["eval_loss"] == pytest.approx(HAND_EVAL_LOSS, abs=1e-6)
        assert out["eval_acc_all"] == pytest.approx(2 / 3) and out["eval_acc_colour"] == pytest.approx(0.5)


def test_filler_batch_is_valid_and_contributes_nothing():
    from vlm_sft.model import build_model, tiny_qwen3_5_config

    filler = filler_batch()
    filler.check()
    scored = score_batch(build_model(tiny_qwen3_5_config()).eval(), filler, CPU)  # the real model accepts it
    assert scored.samples == () and scored.num_tokens == 0 and scored.loss_sum == 0.0
    model = hand_stub()
    assert evaluate(model, [], env=ONE_RANK) == {"eval_loss": 0.0, "eval_tokens": 0}
    assert model.forwards == []  # every rank has no batch: nobody needs a forward


# ------------------------------------------------------------------------------------------------------ memory


def _peak_kb() -> int:
    """This process's own resident high-water mark (``VmHWM``). Not ``ru_maxrss``: Linux carries the parent's peak
    into it across fork + exec, so a child of a large pytest process would measure only what rises above its
    parent's size (eval's chunk then looked 3x too small in a full suite run)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def memory_child(tokens: int, hidden: int, chunk_size: int) -> None:
    """Measures like ``bench/bench_loss_memory.py`` (the high-water mark above the peak after building the inputs): eval
    first, then the chunked training loss (fwd + bwd) on the same tokens. The training loss raises the high-water
    mark further only if its peak is above eval's, so both figures are exact when eval fits its budget."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(QWEN3_5_VOCAB, hidden, generator=gen).mul_(0.02)  # in place: no transient copy
    ids = torch.randint(0, QWEN3_5_VOCAB, (tokens,), generator=gen)
    segment = tokens // 4
    targets = ids.roll(-1)  # within each of the 4 samples the target is the next input
    mask = torch.rand(tokens, generator=gen) > 0.2
    batch = packed_batch(
        [[(k, ids[a : a + segment].tolist(), targets[a : a + segment].tolist(), mask[a : a + segment].tolist())]
         for k, a in enumerate(range(0, tokens, segment))]
    )  # fmt: skip
    model = LMHeadStub(weight, weight, chunk_size)  # tied: the hidden state is the head's own row
    hidden = weight[ids].requires_grad_()
    head = weight.detach().requires_grad_()
    baseline_kb = _peak_kb()
    out = evaluate(model, [batch], env=ONE_RANK)
    eval_kb = _peak_kb()
    loss, count = chunked_cross_entropy(hidden, head, batch.target_ids.view(-1), batch.loss_mask.view(-1))
    loss.backward()
    train_kb = _peak_kb()
    figures = {
        "eval_mb": (eval_kb - baseline_kb) / 1024,
        "train_mb": (train_kb - baseline_kb) / 1024,
        "eval_loss": out["eval_loss"],
        "train_loss": float(loss.detach() / count),
    }
    print(json.dumps(figures))


def test_eval_peak_memory_fits_the_chunked_training_loss():
    """Vocabulary 248,320, 2,048 tokens: eval's peak is below the chunked training loss's (its chunk of logits, without
    the gradient buffers) and far below full fp32 logits (2,048 x 248,320 x 4 B = 1.9 GiB)."""
    tokens, hidden, chunk = 2048, 32, 512
    cmd = [sys.executable, str(Path(__file__).resolve()), "--memory-child", str(tokens), str(hidden), str(chunk)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    chunk_logits_mb = chunk * QWEN3_5_VOCAB * 4 / 2**20  # 485 MB: one chunk's fp32 logits, what both must hold
    full_logits_mb = tokens * QWEN3_5_VOCAB * 4 / 2**20  # 1,940 MB
    assert got["eval_loss"] == pytest.approx(got["train_loss"], rel=1e-5)  # same tokens, same numbers
    # The lower bound only proves the measurement sees a chunk at all: the high-water mark counts pages first touched after the
    # baseline, and the allocator may hand back pages an earlier step already touched (0.84 of a chunk seen under load).
    assert 0.5 * chunk_logits_mb <= got["eval_mb"] < got["train_mb"], got
    assert got["eval_mb"] < 0.4 * full_logits_mb, got


if __name__ == "__main__":
    if sys.argv[1:2] == ["--memory-child"]:
        memory_child(*map(int, sys.argv[2:5]))
