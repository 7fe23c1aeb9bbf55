"""Ask a saved checkpoint: ``python -m vlm_sft.generate PATH (--data FILE | --image IMG --video CLIP --prompt TEXT)
[options]``.

PATH is what a run saved: ``final/``, a ``checkpoints/step-N/hf``, or a LoRA adapter folder (``final/adapter``) on
the base its ``adapter_config.json`` names (or ``--base``). Loading and decoding go through transformers'
``Qwen3_5ForConditionalGeneration`` (or the MoE class: what the config names) and its ``generate``, greedy, and the
prompt through the checkpoint's own chat template with ``add_generation_prompt=True`` and no further arguments (as a
server calls it; ``--enable-thinking`` passes one): what it prints is what a user serving the checkpoint gets.

With ``--data`` (any file the trainer reads: messages or ShareGPT rows, jsonl / json / parquet) every conversation is
cut before its last assistant turn, which is the reference: the reply is scored by exact match (its reasoning left
out, whitespace stripped), per ``task`` where the rows have one, and the accuracy printed at the end.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from vlm_sft.config import exits_cleanly

logger = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vlm_sft.generate", description=__doc__.split("\n\n")[0].replace("``", "")
    )
    parser.add_argument("path", help="an HF checkpoint directory (final/, step-N/hf) or a PEFT adapter folder")
    parser.add_argument("--data", help="a data file: every conversation's last assistant turn is the reference")
    parser.add_argument("--image", action="append", default=[], help="an image for --prompt (repeatable)")
    parser.add_argument("--video", action="append", default=[], help="a video file for --prompt (repeatable)")
    parser.add_argument("--prompt", help="a question to ask (with --image / --video: about them)")
    parser.add_argument("--limit", type=int, default=None, help="ask only the first N conversations of --data")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="longest reply, in tokens (default 64)")
    parser.add_argument(
        "--enable-thinking",
        choices=("true", "false"),
        default=None,
        help="pass enable_thinking to the chat template (default: pass nothing, as a server does: the template's "
        "own default, which a run sets to its data.enable_thinking)",
    )
    parser.add_argument("--base", help="adapter folders: the base checkpoint (default: adapter_config.json's)")
    parser.add_argument("--device", default="auto", help="auto (CUDA when there is one), cpu or cuda")
    parser.add_argument("--out", help="also write one JSON line per conversation here")
    return parser


def load_model(path: Path, base: str | None, device: torch.device) -> tuple[Any, Any]:
    """(transformers model, processor) for a checkpoint directory or an adapter folder on its base."""
    from transformers import AutoModelForImageTextToText

    from processors import load_processor

    adapter_config = path / "adapter_config.json"
    if not adapter_config.is_file():
        model = AutoModelForImageTextToText.from_pretrained(path, dtype="auto")
        return model.to(device).eval(), load_processor(path)
    base = base or json.loads(adapter_config.read_text()).get("base_model_name_or_path")
    if not base or base in ("tiny", "tiny-moe"):
        raise SystemExit(
            f"{path} is an adapter on {base!r}, which is not a checkpoint transformers can load (a random-init preset "
            "has none): ask the merged final/ instead, or pass --base"
        )
    from peft import PeftModel

    model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(base, dtype="auto"), path)
    has_template = (path / "chat_template.jinja").is_file() or (path / "tokenizer_config.json").is_file()
    return model.to(device).eval(), load_processor(path if has_template else base)


def _with_images(messages: list[dict]) -> list[dict]:
    """The messages with every image block's source loaded as a PIL image (``renderers.load_image``: the trainer's
    own reading, paths already resolved inside the data folder by the loader)."""
    from renderers import load_image

    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = [
                {"type": "image", "image": load_image(b.get("image", b.get("image_url")))}
                if isinstance(b, dict) and b.get("type") in ("image", "image_url")
                else b
                for b in content
            ]
        out.append({**m, "content": content})
    return out


def _has_video(messages: list[dict]) -> bool:
    return any(
        isinstance(b, dict) and b.get("type") in ("video", "video_url")
        for m in messages
        if isinstance(m.get("content"), list)
        for b in m["content"]
    )


def _video_prompt(processor: Any, messages: list[dict], tools: Any, template_kwargs: dict) -> Any:
    """The prompt of a conversation with videos, built by our renderer (transformers' video processor needs
    torchvision): the same tokens and pixels ``Qwen3VLProcessor`` makes (``tests/test_video_processor.py``)."""
    from transformers import BatchFeature

    from renderers import get_renderer
    from renderers.served import default_thinking_mode
    from renderers.vision_items import transformers_inputs

    thinking = template_kwargs.get("enable_thinking")
    if thinking is None:
        thinking = bool(default_thinking_mode(processor.chat_template, processor.tokenizer.special_tokens_map))
    sample = get_renderer(processor).render_prompt(messages, tools=tools, thinking=thinking)
    ids = sample.token_ids[None]
    vision = {} if sample.multi_modal_data is None else transformers_inputs(sample.multi_modal_data)
    return BatchFeature(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": sample.mm_token_type_ids[None]}
        | vision
    )


def ask(
    model: Any, processor: Any, messages: list[dict], *, tools: Any = None, max_new_tokens: int, template_kwargs: dict
) -> list[int]:
    """Greedy reply tokens from transformers' ``generate`` for a prompt the chat template builds."""
    from vlm_sft.trainer.generation import STOP_TOKENS

    if _has_video(messages):
        inputs = _video_prompt(processor, messages, tools, template_kwargs).to(model.device)
    else:
        inputs = processor.apply_chat_template(
            _with_images(messages), tools=tools, add_generation_prompt=True, tokenize=True, return_dict=True,
            return_tensors="pt", **template_kwargs,
        ).to(model.device)  # fmt: skip
    stops = processor.tokenizer.convert_tokens_to_ids(list(STOP_TOKENS))
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stops,
            pad_token_id=processor.tokenizer.pad_token_id,
        )  # fmt: skip
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def _conversations(args: argparse.Namespace) -> list[tuple[list[dict], Any, str | None, str]]:
    """(prompt messages, tools, reference or None, task) to ask."""
    from vlm_sft.data.sources import load_conversations
    from vlm_sft.trainer.generation import split_last_reply

    if args.data is None:
        content = [{"type": "video", "video": str(Path(p).resolve())} for p in args.video]
        content += [{"type": "image", "image": str(Path(p).resolve())} for p in args.image]
        return [([{"role": "user", "content": [*content, {"type": "text", "text": args.prompt}]}], None, None, "all")]
    source = load_conversations(args.data)
    tasks = source.column("task") or []
    out = []
    for i in range(len(source) if args.limit is None else min(args.limit, len(source))):
        split = split_last_reply(source[i].messages)
        if split is None:
            logger.warning("row %d has no assistant turn: asked as it is, without a reference", i)
            out.append((source[i].messages, source[i].tools, None, "all"))
            continue
        task = tasks[i] if i < len(tasks) and tasks[i] is not None else "all"
        out.append((split[0], source[i].tools, split[1], str(task)))
    return out


@exits_cleanly
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if (args.data is None) == (args.prompt is None):
        print("give --data FILE, or --prompt TEXT (with --image / --video files)", file=sys.stderr)
        return 2
    if not Path(args.path).exists() and args.path.count("/") != 1:  # org/name: a hub checkpoint
        raise FileNotFoundError(f"no checkpoint folder {args.path} (a run's final/ or step-N/hf, or an adapter folder)")
    from vlm_sft.trainer.generation import is_correct, reply_text

    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if args.device == "auto" else args.device)
    model, processor = load_model(Path(args.path), args.base, device)
    kwargs = {} if args.enable_thinking is None else {"enable_thinking": args.enable_thinking == "true"}
    rows, right, seen = [], Counter(), Counter()
    conversations = _conversations(args)
    bar = tqdm(conversations, desc="generating", disable=len(conversations) < 2)
    for i, (messages, tools, reference, task) in enumerate(bar):
        tokens = ask(
            model, processor, messages, tools=tools, max_new_tokens=args.max_new_tokens, template_kwargs=kwargs
        )
        reply = reply_text(processor.tokenizer, tokens)
        row = {"index": i, "task": task, "reply": reply, "reference": reference}
        if reference is not None:
            row["correct"] = is_correct(reply, reference)
            for key in {task, "all"}:
                seen[key] += 1
                right[key] += row["correct"]
        rows.append(row)
        mark = "" if reference is None else (" [right]" if row["correct"] else f" [wrong; reference {reference!r}]")
        tqdm.write(f"{i}: {reply!r}{mark}")
    for key in sorted(seen):
        print(f"accuracy {key}: {right[key]}/{seen[key]} = {right[key] / seen[key]:.3f}")
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
