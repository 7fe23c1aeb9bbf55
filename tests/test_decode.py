"""Incremental decoding (``vlm_sft.model.decode``): a cached decode step gives what a full forward gives.

Kernels first (``gdn.final_states`` vs the token-by-token recurrence, ``recurrent_step`` / ``conv_step`` continuing
the varlen ops), then the whole model, dense, MoE and with LoRA: prompts with one image, two images and text only
(one shorter than the conv width) prefilled packed in one row, then decode steps whose logits must equal the last
logits of a plain no-cache forward of each sequence's whole prefix alone. Each test says the bug it guards against.
The models use ``initializer_range=0.05``, so a wrong state or position moves the logits far above the tolerance
(at the preset's 0.02 a 1% error of the GatedDeltaNet state moved them by only ~5e-5), while float32 rounding stays
below it (measured: no-cache float32 is 2.6e-6 from float64, and so is the cached path). In float64 the cached
path equals the no-cache forward to ~1e-15, which the float64 runs hold at 1e-10.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from packing_helpers import alone_logits, make_sample, packed_row
from torch.distributed.utils import _apply_to_tensors

from vlm_sft.model import build_model, tiny_qwen3_5_config, tiny_qwen3_5_moe_config
from vlm_sft.model.conv import causal_conv1d, conv_step, conv_tail
from vlm_sft.model.decode import DecodeCache, decode_position_ids, next_positions
from vlm_sft.model.gdn import final_states, gated_delta_rule, recurrent_step
from vlm_sft.model.lora import attach_lora, init_adapters
from vlm_sft.model.varlen import Segments
from vlm_sft.parallel.context_parallel import NO_CP, ContextParallel

TOL = 1e-5
TOL_64 = 1e-10
INIT = 0.05
STEPS = 6
TEXT_VOCAB = 2048  # regular tokens (packing_helpers.TEXT_VOCAB)


# ---------------------------------------------------------------- kernels


def _gdn_inputs(lens, dtype=torch.float32, k_heads=2, v_heads=4, dim=16):
    """Key heads fewer than value heads (as the real model); decays near 1 so the state carries far."""
    t = sum(lens)
    q, k = torch.randn(t, k_heads, dim, dtype=dtype), torch.randn(t, k_heads, dim, dtype=dtype)
    v = torch.randn(t, v_heads, dim, dtype=dtype)
    g = F.logsigmoid(torch.randn(t, v_heads, dtype=dtype) + 2.0)
    beta = torch.rand(t, v_heads, dtype=dtype)
    return q, k, v, g, beta


def _reference_states(q, k, v, g, beta, lens):
    """Each segment's final state by the recurrence itself, one token at a time (float64, l2-normed k)."""
    k = k.double().repeat_interleave(v.shape[1] // k.shape[1], dim=1)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    v, g, beta = v.double(), g.double(), beta.double()
    states, start = [], 0
    for n in lens:
        state = v.new_zeros(v.shape[1], k.shape[-1], v.shape[-1])
        for t in range(start, start + n):
            state = state * g[t].exp()[:, None, None]
            delta = (v[t] - (state * k[t][:, :, None]).sum(1)) * beta[t][:, None]
            state = state + k[t][:, :, None] * delta[:, None, :]
        states.append(state)
        start += n
    return torch.stack(states)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, TOL), (torch.float64, 1e-10)])
def test_final_states_equal_the_recurrence(dtype, tol):
    """Guards: a segment's state taken at the wrong scan step or given to another segment (the lengths are packed
    out of chunk-count order, so chunk_layout's ranking must be undone), padding that decays or writes the state, an
    empty segment that is not zero."""
    lens = [65, 1, 130, 2, 0, 64, 17, 63]
    inputs = _gdn_inputs(lens, dtype)
    got = final_states(*inputs, Segments.from_lengths(lens))
    want = _reference_states(*inputs, lens)
    assert got.shape == (len(lens), 4, 16, 16) and got.dtype == dtype
    assert float(want.abs().max()) > 0.5  # the states are not small: the tolerance is meaningful
    torch.testing.assert_close(got.double(), want, rtol=0, atol=tol)
    assert float(got[4].abs().max()) == 0.0


def test_recurrent_step_continues_the_chunked_rule():
    """Guards: a step that decays after the update, forgets the key-head repeat, the l2 norm or the query scale
    (its outputs would differ from the chunked rule's), or a prefill state that does not continue (final_states)."""
    lens, prompt, steps = [70, 3, 1], [66, 1, 0], [4, 2, 1]
    q, k, v, g, beta = _gdn_inputs(lens)
    full = gated_delta_rule(q, k, v, g, beta, Segments.from_lengths(lens), backend="torch")
    starts = [sum(lens[:s]) for s in range(len(lens))]
    head = [i for s, n in enumerate(prompt) for i in range(starts[s], starts[s] + n)]
    state = final_states(*(x[head] for x in (q, k, v, g, beta)), Segments.from_lengths(prompt))
    for j in range(max(steps)):
        rows = [starts[s] + prompt[s] + min(j, steps[s] - 1) for s in range(len(lens))]  # finished: repeat, unused
        live = [s for s in range(len(lens)) if j < steps[s]]
        o, new_state = recurrent_step(*(x[rows] for x in (q, k, v, g, beta)), state)
        torch.testing.assert_close(o[live], full[[rows[s] for s in live]], rtol=0, atol=TOL)
        state = torch.where(torch.tensor([j < n for n in steps])[:, None, None, None], new_state, state)
    torch.testing.assert_close(state, final_states(q, k, v, g, beta, Segments.from_lengths(lens)), rtol=0, atol=TOL)


def test_conv_step_continues_the_varlen_conv():
    """Guards: a tail in the wrong order, taken across a segment start, or without the zero rows of a prompt shorter
    than W - 1 (prompts of 1 and 2 tokens), and a step that shifts the tail the wrong way."""
    lens, prompt, channels, width = [6, 5, 9, 4], [1, 2, 5, 3], 8, 4
    x = torch.randn(sum(lens), channels)
    weight, bias = torch.randn(channels, width), torch.randn(channels)
    full = causal_conv1d(x, weight, bias, Segments.from_lengths(lens), backend="torch")
    starts = [sum(lens[:s]) for s in range(len(lens))]
    head = [i for s, n in enumerate(prompt) for i in range(starts[s], starts[s] + n)]
    tail = conv_tail(x[head], Segments.from_lengths(prompt), width)
    assert tail.shape == (len(lens), width - 1, channels)
    assert float(tail[0, :2].abs().max()) == 0.0 and float(tail[1, :1].abs().max()) == 0.0
    for j in range(min(n - p for n, p in zip(lens, prompt, strict=True))):
        rows = [starts[s] + prompt[s] + j for s in range(len(lens))]
        y, tail = conv_step(x[rows], tail, weight, bias)
        torch.testing.assert_close(y, full[rows], rtol=0, atol=1e-6)


# ---------------------------------------------------------------- the model


def _prompts(cfg, seed=1, dtype=torch.float32):
    """One image, two adjacent images, and two text tokens (shorter than the conv width of 4)."""
    gen = torch.Generator().manual_seed(seed)
    out = [make_sample(cfg, 3, [(1, 4, 4)], 5, gen), make_sample(cfg, 2, [(1, 2, 4), (1, 4, 2)], 3, gen)]
    out += [make_sample(cfg, 2, [], 0, gen)]
    return [s | {"pixel_values": None if s["pixel_values"] is None else s["pixel_values"].to(dtype)} for s in out]


def _prefill(model, prompts, cache):
    lens = [len(s["input_ids"]) for s in prompts]
    row = packed_row(prompts) if any(s["pixel_values"] is not None for s in prompts) else _text_row(prompts)
    return model(**row, seq_lens=lens, cache=cache), next_positions(row["position_ids"], lens)


def _text_row(prompts):
    return {
        "input_ids": torch.cat([s["input_ids"] for s in prompts])[None],
        "position_ids": torch.cat([s["position_ids"] for s in prompts], dim=1)[:, None],
        "mm_token_type_ids": torch.cat([s["mm_token_type_ids"] for s in prompts])[None],
    }


def _extend(sample, token: int, pos_3: torch.Tensor) -> dict:
    """``sample`` with one more text token at position ``pos_3`` (the no-cache reference's prefix)."""
    return sample | {
        "input_ids": torch.cat([sample["input_ids"], torch.tensor([token])]),
        "position_ids": torch.cat([sample["position_ids"], pos_3[:, None]], dim=1),
        "mm_token_type_ids": torch.cat([sample["mm_token_type_ids"], torch.zeros(1, dtype=torch.long)]),
    }


def _last_logits(model, s) -> torch.Tensor:
    """The last position's logits of a plain forward of ``s`` alone (no cache)."""
    return alone_logits(model, s)[-1]


def _dense(dtype=torch.float32):
    return build_model(tiny_qwen3_5_config(initializer_range=INIT), dtype=dtype).eval()


def _moe(dtype=torch.float32):
    experts = "auto" if dtype == torch.float32 else "sorted"  # grouped_mm has no float64
    return build_model(tiny_qwen3_5_moe_config(initializer_range=INIT), dtype=dtype, experts_impl=experts).eval()


def _lora(dtype=torch.float32):
    model = _dense(dtype)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj", "down_proj"]
    attach_lora(model, r=4, alpha=8, dropout=0.0, targets=targets)
    init_adapters(model, seed=0)
    with torch.no_grad():  # peft starts B at zero: an adapter the cached path skipped would go unnoticed
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0.0, 0.1)
    return model


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, TOL), (torch.float64, TOL_64)], ids=["fp32", "fp64"])
@pytest.mark.parametrize("make_model", [_dense, _moe, _lora], ids=["dense", "moe", "lora"])
@torch.no_grad()
def test_decode_steps_equal_full_forwards_of_each_prefix(make_model, dtype, tol):
    """Guards: any cache that goes stale or misses a term (conv tail, GatedDeltaNet state, the attention layer's own
    new key, the key of a previous step, rotary on the cached keys), a sequence reading another's cache, the buffers'
    growth (``reserve_tokens=2``: it grows twice), and a layer (MoE, LoRA-adapted projections) that the cached path
    runs differently. The positions themselves are ``test_next_positions_continue_after_the_largest_position``'s."""
    model = make_model(dtype)
    cfg = model.config
    prompts = _prompts(cfg, dtype=dtype)
    cache = DecodeCache(reserve_tokens=2)
    logits, starts = _prefill(model, prompts, cache)
    assert logits.shape == (3, cfg.text_config.vocab_size)
    assert starts[0] < len(prompts[0]["input_ids"])  # the image prompt's next position is not its length
    seqs = list(prompts)
    tokens = torch.randint(0, TEXT_VOCAB, (STEPS, 3, 1), generator=torch.Generator().manual_seed(2))
    for step in range(STEPS + 1):
        for s, seq in enumerate(seqs):
            torch.testing.assert_close(logits[s], _last_logits(model, seq), rtol=0, atol=tol)
        if step == STEPS:
            break
        pos = decode_position_ids(starts, step)
        seqs = [_extend(seq, int(tokens[step, s]), pos[:, s, 0]) for s, seq in enumerate(seqs)]
        logits = model(tokens[step], position_ids=pos, cache=cache)
    assert cache.steps == STEPS


@pytest.fixture(scope="module")
def dense():
    torch.manual_seed(0)
    return _dense()


@torch.no_grad()
def test_packed_prefill_equals_each_prompt_alone(dense):
    """Guards: a cache filled across segment boundaries (a conv tail or state reading the previous prompt, keys
    stored at the wrong row or offset): packed and alone would diverge, at the prefill or in later steps."""
    prompts = _prompts(dense.config)
    packed = DecodeCache()
    logits, starts = _prefill(dense, prompts, packed)
    alone = [DecodeCache() for _ in prompts]
    alone_logits = [_prefill(dense, [p], c) for p, c in zip(prompts, alone, strict=True)]
    torch.testing.assert_close(logits, torch.cat([lg for lg, _ in alone_logits]), rtol=0, atol=TOL)
    assert starts == [st[0] for _, st in alone_logits]
    for step in range(3):
        tokens = torch.randint(0, TEXT_VOCAB, (3, 1))
        logits = dense(tokens, position_ids=decode_position_ids(starts, step), cache=packed)
        for s, c in enumerate(alone):
            one = dense(tokens[s : s + 1], position_ids=decode_position_ids(starts[s : s + 1], step), cache=c)
            torch.testing.assert_close(logits[s : s + 1], one, rtol=0, atol=TOL)


@torch.no_grad()
def test_greedy_with_cache_equals_greedy_without(dense):
    """The cache gives the same tokens as no cache: 8 greedy tokens per prompt, each reference token from a full
    forward of the whole prefix. Guards: any cached-path error large enough to flip an argmax."""
    prompts = _prompts(dense.config)
    cache = DecodeCache()
    logits, starts = _prefill(dense, prompts, cache)
    cached = [[] for _ in prompts]
    for step in range(8):
        next_S = logits.argmax(-1)
        for s in range(len(prompts)):
            cached[s].append(int(next_S[s]))
        logits = dense(next_S[:, None], position_ids=decode_position_ids(starts, step), cache=cache)
    for s, seq in enumerate(prompts):
        plain = []
        for step in range(8):
            plain.append(int(_last_logits(dense, seq).argmax()))
            seq = _extend(seq, plain[-1], decode_position_ids(starts[s : s + 1], step)[:, 0, 0])
        assert cached[s] == plain
    assert len({t for row in cached for t in row}) > 1  # not one token repeated: the comparison can fail


@torch.no_grad()
def test_bad_cached_calls_are_refused(dense):
    """Guards: a decode call that silently runs on the wrong sequences (wrong S, several tokens), with images,
    targets, with autograd on (the cache would hold every step's graph), or under context parallelism (whose shards
    the cache does not know), and an empty prompt."""
    prompts = _prompts(dense.config)
    row = _text_row(prompts[2:])
    with pytest.raises(ValueError, match="positive"):
        dense(**row, seq_lens=[2, 0], cache=DecodeCache())
    with pytest.raises(ValueError, match="target_ids"):
        dense(**row, target_ids=row["input_ids"], cache=DecodeCache())
    with torch.enable_grad(), pytest.raises(ValueError, match="no_grad"):
        dense(**row, cache=DecodeCache())
    dense.context_parallel = ContextParallel(group=None, rank=0, size=2)  # faked: the refusal comes before any use
    try:
        with pytest.raises(ValueError, match=r"apply_context_parallel\(model, NO_CP\)"):
            dense(**row, cache=DecodeCache())
    finally:
        dense.context_parallel = NO_CP
    cache = DecodeCache()
    _, starts = _prefill(dense, prompts, cache)
    pos = decode_position_ids(starts, 0)
    with pytest.raises(ValueError, match=r"\[S, 1\] = \[3, 1\]"):
        dense(torch.zeros(2, 1, dtype=torch.long), position_ids=pos[:, :2], cache=cache)
    with pytest.raises(ValueError, match=r"\[S, 1\] = \[3, 1\]"):
        dense(torch.zeros(3, 2, dtype=torch.long), position_ids=pos.expand(3, 3, 2), cache=cache)
    with pytest.raises(ValueError, match="text tokens only"):
        dense(torch.zeros(3, 1, dtype=torch.long), position_ids=pos, pixel_values=prompts[0]["pixel_values"],
              image_grid_thw=prompts[0]["image_grid_thw"], cache=cache)  # fmt: skip
    assert cache.steps == 0  # refused calls changed nothing: the cache still decodes
    dense(torch.zeros(3, 1, dtype=torch.long), position_ids=pos, cache=cache)
    assert cache.steps == 1


def test_cache_passes_fsdp_input_hooks_as_itself():
    """FSDP2 maps its pre-forward hooks over the arguments and rebuilds every dataclass it meets (to move and cast
    tensors): a dataclass cache would reach the layers as a copy, and the caller's would never be filled. Guards
    against turning the cache classes into dataclasses."""
    cache = DecodeCache()
    cache.start(["linear_attention", "full_attention"], [3])
    assert not dataclasses.is_dataclass(cache) and not any(dataclasses.is_dataclass(c) for c in cache.layers)
    cast = _apply_to_tensors(lambda t: t.to(torch.bfloat16), ((cache, cache.layers[0]), {"cache": cache}))
    assert cast[0][0] is cache and cast[0][1] is cache.layers[0] and cast[1]["cache"] is cache


def test_next_positions_continue_after_the_largest_position():
    """An image's tokens share temporal positions, so the prompt's largest position + 1 is less than its length
    (what transformers' Qwen3.5 continues at); a text prompt continues at its length."""
    cfg = tiny_qwen3_5_config()
    prompts = _prompts(cfg)
    row = packed_row(prompts)
    lens = [len(s["input_ids"]) for s in prompts]
    starts = next_positions(row["position_ids"], torch.tensor(lens))
    assert starts == [int(s["position_ids"].max()) + 1 for s in prompts]
    assert starts[2] == lens[2] and starts[0] < lens[0]
    assert decode_position_ids(starts, 3).tolist() == [[[p + 3] for p in starts]] * 3
