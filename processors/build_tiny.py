"""Build the offline tiny Qwen3.5 processor that tests and the default run use instead of a hub download.

Run ``python -m processors.build_tiny [--out DIR]`` to regenerate the committed files in
``processors/assets/tiny-qwen3_5/`` (a few seconds on a laptop CPU). Everything here is deterministic: the corpus
comes from a seeded generator, the ``tokenizers`` BPE trainer gives the same merges for the same corpus, and the
files are written by ``save_processor`` with sorted-key JSON, so two runs give byte-identical files (a test checks).

What is built, and why it looks like the real Qwen3.5 processor:
- a byte-level BPE tokenizer with Qwen3.5's own pipeline (NFC normalizer, the Qwen3.5 split regex, ByteLevel
  without a prefix space), ``TINY_REGULAR_VOCAB_SIZE`` regular tokens, then the Qwen3.5 added tokens in their real
  order (so their ids are ``2048 + index``), eos ``<|im_end|>`` and pad ``<|endoftext|>``;
- our chat template (``processors/chat_template.jinja``), which renders the real Qwen3.5 chat format;
- transformers' Qwen2-VL image processor on its PIL backend with Qwen3.5's patch 16 / temporal 2 / merge 2 and
  mean = std = 0.5, bounded to small images (a 64x64 image is a (1, 4, 4) grid, 4 image tokens);
- all of it composed as transformers' ``Qwen3VLProcessor``, the class ``AutoProcessor`` maps qwen3_5 to.
"""

from __future__ import annotations

import argparse
import logging
import random
import time
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX, Qwen3_5Tokenizer

from processors.loading import TINY_PROCESSOR_DIR, compose_processor, save_processor
from processors.special_tokens import (
    EOS_TOKEN,
    NOT_SPECIAL,
    PAD_TOKEN,
    QWEN3_5_SPECIAL_TOKENS,
    TINY_REGULAR_VOCAB_SIZE,
    TINY_VOCAB_SIZE,
    tiny_token_id,
)

logger = logging.getLogger(__name__)

CHAT_TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")
"""Source of the chat template; the build copies it into the assets (``chat_template.jinja``)."""

CORPUS_SEED = 20240611
"""Seed of the training corpus; changing it changes every merge, so the assets must be rebuilt."""

PATCH_SIZE = 16
TEMPORAL_PATCH_SIZE = 2
MERGE_SIZE = 2
IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)
MIN_PIXELS = 32 * 32
"""Smallest resized area: one 32x32 block (patch 16 x merge 2), a single image token."""
MAX_PIXELS = 256 * 256
"""Largest resized area: 64 image tokens, plenty for the shapes dataset and cheap on CPU."""
MODEL_MAX_LENGTH = 262144
"""Qwen3.5's context length, as its tokenizer_config.json says."""


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


# ---------------------------------------------------------------------------------------------------------------
# Corpus: short English about colours, shapes, counts and positions (the shapes dataset's vocabulary), generic
# assistant chat, tool-call and JSON text, numbers and punctuation, and some non-ASCII text so that common
# multi-byte characters get their own tokens. Added tokens never appear in it: they are split off before BPE.
# ---------------------------------------------------------------------------------------------------------------

COLOURS = _words(
    "red green blue yellow orange purple pink brown black white grey gray cyan magenta violet teal navy "
    "maroon olive lime gold silver beige turquoise"
)
SHAPES = _words("circle square triangle rectangle star hexagon diamond ellipse pentagon cross heart oval ring arrow")
SIZES = _words("small large big tiny huge medium little")
POSITIONS = (
    "left",
    "right",
    "top",
    "bottom",
    "centre",
    "center",
    "middle",
    "top left",
    "top right",
    "bottom left",
    "bottom right",
    "upper half",
    "lower half",
)
NUMBER_WORDS = _words("zero one two three four five six seven eight nine ten eleven twelve")
CHAT_SENTENCES = (
    "You are a helpful assistant.",
    "You are concise.",
    "Sure, here is what I found.",
    "I can help you with that.",
    "Let me think about this step by step.",
    "The answer is shown below.",
    "Could you tell me more about the image?",
    "Thank you for your question!",
    "I am not sure, but I will try my best.",
    "Here is a short summary of the picture.",
    "Please describe the image in detail.",
    "What do you see in this picture?",
    "Answer with a single word.",
    "Explain your reasoning briefly.",
    "That is correct.",
    "No, that is not right; let me check again.",
    "First, I look at the whole image. Then I count the shapes.",
    "The user is asking about the colour of the shape.",
    "I should answer the question directly and keep it short.",
    "Okay, so the question is how many shapes there are.",
    "Wait, let me look again at the left side.",
    "In summary, the image contains several coloured shapes.",
    "Is there anything else you would like to know?",
    "The weather in Paris is sunny with a high of 24 degrees.",
    "I will call a function to get the current weather.",
    "If there is no function call available, answer the question like normal.",
    "Function calls MUST follow the specified format.",
    "Required parameters MUST be specified.",
    "You have access to the following functions:",
    "This is the value for the second parameter that can span multiple lines.",
)
QUESTIONS = (
    "What colour is the {shape}?",
    "What color is the {size} {shape}?",
    "How many {shape}s are there?",
    "How many {colour} shapes are in the image?",
    "Where is the {colour} {shape}?",
    "Which shape is {colour}?",
    "Is the {shape} on the {position}?",
    "What shape is in the {position} of the image?",
    "Describe the image.",
    "Compare the two images.",
    "What is different between the first and the second picture?",
)
ANSWERS = (
    "The {shape} is {colour}.",
    "It is {colour}.",
    "There are {count} {shape}s.",
    "There is {count_word} {colour} {shape} in the image.",
    "The {colour} {shape} is at the {position}.",
    "The {size} {colour} {shape} is in the {position} of the picture.",
    "I see {count_word} shapes: a {colour} {shape} and a {colour2} {shape2}.",
    "Yes, the {shape} is on the {position}.",
    "No, the {shape} is on the {position}.",
    "The first image shows a {colour} {shape}; the second one shows a {colour2} {shape2}.",
)
COMMON_WORDS = _words(
    "about above across after again against all almost alone along already also although always among an and "
    "another answer any anyone anything appear apple area around ask asked away back background be because become "
    "been before began begin behind being believe below beside best better between beyond bird black board boat body "
    "book both box boy bring brought build building built but buy by call came can car card care carry case cat "
    "cause change check child children choose city class clear close cold come common complete consider contain "
    "continue corner correct could country course cover create cross cup cut dark data day decide describe detail "
    "did different direction do does dog done door down draw drawing during each early earth easy edge effect eight "
    "either else end enough even evening ever every example explain eye face fact family far fast feel few field "
    "figure fill find fine finish fire first fish five floor follow food for form found four frame free friend "
    "from front full game gave general get give given glass go good got great ground group grow had half hand happen "
    "hard has have he head hear help her here high him his hold home hour house how however idea if important in "
    "include inside instead into it its itself just keep kind knew know land language last late later learn least "
    "leave less let letter level light like line list listen long look lot low made main make many map mark may mean "
    "measure might mind minute miss model more morning most mother move much must my name near need never new next "
    "night no not note nothing notice now number object of off often old on once only open or order other our out "
    "outside over own page paper part pass pattern people perhaps person photo picture piece place plan plant play "
    "point possible present probably problem process produce question quick quite rather reach read ready real "
    "really reason remember rest result return river road rock room round row rule run said same saw say school sea "
    "second see seem seen sentence set several she short should show side simple since size sky so some something "
    "sometimes soon sound space stand start state step still stop story street strong study such sun sure surface "
    "table take talk tell than that their them then there these they thing think this those though thought through "
    "time to together told too took toward tree true try turn under understand until up upon us use usually very "
    "view visible wall want was watch water way we well went were what when where whether which while white who "
    "whole why will with within without word work world would write year yes yet you young your"
)
TOOL_NAMES = _words("get_weather search_images count_shapes describe_image lookup convert_units send_message")
PARAM_NAMES = _words("city query colour shape count unit text image_id language limit")
NON_ASCII = (
    "Der Kreis ist grün und das Quadrat ist blau.",
    "Le cercle est rouge, le carré est vert et le triangle est jaune.",
    "El círculo está a la izquierda; el cuadrado está a la derecha.",
    "Il triangolo è arancione e la stella è viola.",
    "Красный круг находится слева, синий квадрат справа.",
    "Ο κύκλος είναι κόκκινος και το τετράγωνο είναι μπλε.",
    "红色的圆形在左边，蓝色的正方形在右边。图片里有三个形状。",
    "赤い円は左にあります。青い四角形は右にあります。",
    "빨간 원은 왼쪽에 있고 파란 사각형은 오른쪽에 있습니다.",
    "Café, naïve, résumé, façade, Zürich, São Paulo, Ångström, coöperate.",
    "Emoji: 🙂 👍 🔴 🟢 🔵 ⭐ ✅ ❌ → ← ↑ ↓ ° ± × ÷ € £ ¥ © ™",
    "“Quotes” and ‘single quotes’ — dashes – and ellipses…",
)
CODE_SNIPPETS = (
    'def count(shapes):\n    return len([s for s in shapes if s["colour"] == "red"])\n',
    'import json\n\ndata = json.loads(text)\nprint(data["shapes"][0])\n',
    "for i in range(10):\n    total += i * 2\n",
    'if x > 0 and y < 10:\n    return {"x": x, "y": y}\n',
    "SELECT colour, COUNT(*) FROM shapes GROUP BY colour;\n",
)


def _render_sample(rng: random.Random, template: str) -> str:
    count = rng.randint(0, 12)
    return template.format(
        shape=rng.choice(SHAPES),
        shape2=rng.choice(SHAPES),
        colour=rng.choice(COLOURS),
        colour2=rng.choice(COLOURS),
        size=rng.choice(SIZES),
        position=rng.choice(POSITIONS),
        count=count,
        count_word=NUMBER_WORDS[count],
    )


def _tool_text(rng: random.Random) -> str:
    """A tool spec, a tool call and a tool result, as the chat template writes them (added tokens left out)."""
    name = rng.choice(TOOL_NAMES)
    params = rng.sample(PARAM_NAMES, rng.randint(1, 3))
    spec = (
        '{"type": "function", "function": {"name": "'
        + name
        + '", "description": "'
        + rng.choice(CHAT_SENTENCES)
        + '", "parameters": {"type": "object", "properties": {'
        + ", ".join(f'"{p}": {{"type": "{rng.choice(["string", "integer", "number", "boolean"])}"}}' for p in params)
        + '}, "required": ["'
        + params[0]
        + '"]}}}'
    )
    call = (
        f"\n<function={name}>\n"
        + "".join(
            f"<parameter={p}>\n{_render_sample(rng, '{colour} {shape}') if rng.random() < 0.5 else rng.randint(0, 999)}"
            "\n</parameter>\n"
            for p in params
        )
        + "</function>\n"
    )
    result = (
        '\n{"result": "' + _render_sample(rng, rng.choice(ANSWERS)) + '", "count": ' + str(rng.randint(0, 99)) + "}\n"
    )
    return "\n".join(["<tools>", spec, "</tools>", call, result])


def _conversation_text(rng: random.Random) -> str:
    """One rendered-looking conversation: role headers, thinking, answers, the separators between turns."""
    parts = ["system\n" + rng.choice(CHAT_SENTENCES)]
    for _ in range(rng.randint(1, 3)):
        parts.append("user\n" + _render_sample(rng, rng.choice(QUESTIONS)))
        thinking = " ".join(_render_sample(rng, rng.choice(ANSWERS)) for _ in range(rng.randint(0, 2)))
        answer = _render_sample(rng, rng.choice(ANSWERS))
        parts.append(f"assistant\n\n{thinking}\n\n\n{answer}" if thinking else f"assistant\n\n\n\n{answer}")
    return "\n\n".join(parts) + "\n"


def corpus_lines(seed: int = CORPUS_SEED, n_blocks: int = 6000) -> list[str]:
    """The deterministic training corpus: ``n_blocks`` seeded mixes of the kinds of text listed above."""
    rng = random.Random(seed)
    lines: list[str] = [*CHAT_SENTENCES, *NON_ASCII, *CODE_SNIPPETS]
    for _ in range(n_blocks):
        kind = rng.random()
        if kind < 0.35:
            lines.append(_render_sample(rng, rng.choice(QUESTIONS)) + " " + _render_sample(rng, rng.choice(ANSWERS)))
        elif kind < 0.6:
            lines.append(_conversation_text(rng))
        elif kind < 0.7:
            lines.append(_tool_text(rng))
        elif kind < 0.75:
            lines.append(rng.choice(NON_ASCII))
        elif kind < 0.9:
            words = [rng.choice(COMMON_WORDS) for _ in range(rng.randint(6, 18))]
            sentence = " ".join(words)
            lines.append(sentence[0].upper() + sentence[1:] + rng.choice((".", "?", "!", ",", ";", ":")))
        elif kind < 0.95:
            numbers = [rng.randint(0, 10 ** rng.randint(1, 6)) for _ in range(4)]
            lines.append(
                f"{numbers[0]} + {numbers[1]} = {numbers[0] + numbers[1]}; {numbers[2]}.{numbers[3]}%, #{rng.randint(1, 9)}!"
            )
        else:
            lines.append(rng.choice(CODE_SNIPPETS))
    return lines


def qwen3_5_pipeline(tokenizer: Tokenizer) -> Tokenizer:
    """Give ``tokenizer`` Qwen3.5's normalizer, pre-tokenizer and decoder (those of ``Qwen3_5Tokenizer``)."""
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train_bpe(lines: list[str]) -> Tokenizer:
    """Train exactly ``TINY_REGULAR_VOCAB_SIZE`` byte-level BPE tokens (256 bytes + merges) on ``lines``."""
    tokenizer = qwen3_5_pipeline(Tokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_REGULAR_VOCAB_SIZE,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(lines, trainer=trainer)
    if tokenizer.get_vocab_size() != TINY_REGULAR_VOCAB_SIZE:
        raise RuntimeError(
            f"BPE training gave {tokenizer.get_vocab_size()} tokens, not {TINY_REGULAR_VOCAB_SIZE}: "
            "the corpus is too small for that many merges; add text to corpus_lines"
        )
    return tokenizer


def build_tiny_tokenizer() -> Qwen3_5Tokenizer:
    """The tiny tokenizer: trained BPE, then the Qwen3.5 added tokens in order (ids 2048 + index)."""
    backend = train_bpe(corpus_lines())
    for token in QWEN3_5_SPECIAL_TOKENS:
        backend.add_tokens([AddedToken(token, special=token not in NOT_SPECIAL, normalized=False)])
    tokenizer = Qwen3_5Tokenizer(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")
    if len(tokenizer) != TINY_VOCAB_SIZE:
        raise RuntimeError(f"tiny tokenizer has {len(tokenizer)} tokens, expected {TINY_VOCAB_SIZE}")
    for token in QWEN3_5_SPECIAL_TOKENS:
        got = tokenizer.convert_tokens_to_ids(token)
        if got != tiny_token_id(token):
            raise RuntimeError(f"{token} got id {got}, processors.special_tokens says {tiny_token_id(token)}")
    return tokenizer


def build_image_processor() -> Qwen2VLImageProcessorPil:
    """Qwen3.5's image settings on the PIL backend, bounded to small images."""
    return Qwen2VLImageProcessorPil(
        patch_size=PATCH_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        merge_size=MERGE_SIZE,
        image_mean=list(IMAGE_MEAN),
        image_std=list(IMAGE_STD),
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    )


def build_tiny_processor():
    """The tiny ``Qwen3VLProcessor`` and its tokenizer (the same object), ready for ``save_processor``."""
    tokenizer = build_tiny_tokenizer()
    processor = compose_processor(tokenizer, build_image_processor(), tokenizer.chat_template)
    return processor, tokenizer


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=TINY_PROCESSOR_DIR, help="output directory (default: %(default)s)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    logger.info(
        "building the tiny Qwen3.5 processor (BPE %d + %d added tokens)",
        TINY_REGULAR_VOCAB_SIZE,
        len(QWEN3_5_SPECIAL_TOKENS),
    )
    processor, tokenizer = build_tiny_processor()
    save_processor(args.out, processor, tokenizer)
    logger.info("wrote and verified %s in %.1f s", args.out, time.perf_counter() - start)
    return args.out


if __name__ == "__main__":
    main()
