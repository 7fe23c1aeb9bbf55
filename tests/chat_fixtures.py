"""Shared test values: the tool of the real Qwen3.5 reference renderings, and hand-written conversations."""

from __future__ import annotations

from PIL import Image, ImageDraw

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Return the weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


COLOURS = [(220, 40, 40), (40, 180, 60), (40, 70, 220), (235, 210, 40)]


def shape_image(i: int, size: tuple[int, int] = (64, 64)) -> Image.Image:
    img = Image.new("RGB", size, (230, 230 - 5 * i, 220))
    w, h = size
    ImageDraw.Draw(img).ellipse((w // 4, h // 4, 3 * w // 4, 3 * h // 4), fill=COLOURS[i % len(COLOURS)])
    return img


def img(path: str) -> dict:
    return {"type": "image", "image": path}


def txt(text: str) -> dict:
    return {"type": "text", "text": text}


def conversations(paths: list[str]) -> dict[str, tuple[list[dict], list[dict] | None]]:
    """Hand-written cases, each (messages, tools)."""
    p = paths
    weather_call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    return {
        "text_only": ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}], None),
        "system_prompt": (
            [
                {"role": "system", "content": "You are concise."},
                {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "Four."},
            ],
            None,
        ),
        "one_image": (
            [{"role": "user", "content": [img(p[0]), txt("Colour?")]}, {"role": "assistant", "content": "Red."}],
            None,
        ),
        "image_after_text": (
            [{"role": "user", "content": [txt("Look: "), img(p[1])]}, {"role": "assistant", "content": "Green."}],
            None,
        ),
        "three_images_one_turn": (
            [
                {"role": "user", "content": [img(p[0]), img(p[2]), txt("Compare"), img(p[3])]},
                {"role": "assistant", "content": "All differ."},
            ],
            None,
        ),
        "images_in_several_turns": (
            [
                {"role": "system", "content": [txt("Describe pictures.")]},
                {"role": "user", "content": [img(p[0]), txt("First?")]},
                {"role": "assistant", "content": [txt("A red circle.")]},
                {"role": "user", "content": [img(p[1]), txt("And this?")]},
                {"role": "assistant", "content": [txt("A green one.")]},
                {"role": "user", "content": [txt("Both again"), img(p[0]), img(p[4])]},
                {"role": "assistant", "content": "Red, then blue."},
            ],
            None,
        ),
        "multi_turn_text": (
            [
                {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "Prior answer."},
                {"role": "user", "content": "And 3+3?"},
                {"role": "assistant", "content": "Six."},
            ],
            None,
        ),
        "reasoning_content": (
            [
                {"role": "user", "content": [img(p[2]), txt("Shape?")]},
                {"role": "assistant", "reasoning_content": "Round, so a circle.", "content": "A circle."},
            ],
            None,
        ),
        "think_in_content": (
            [
                {"role": "user", "content": "Why?"},
                {"role": "assistant", "content": "<think>\nBecause of physics.\n</think>\n\nPhysics."},
            ],
            None,
        ),
        "reasoning_in_history": (
            [
                {"role": "user", "content": "One?"},
                {"role": "assistant", "reasoning_content": "dropped from history", "content": "1"},
                {"role": "user", "content": "Two?"},
                {"role": "assistant", "reasoning_content": "kept", "content": "2"},
            ],
            None,
        ),
        "tool_call_and_result": (
            [
                {"role": "system", "content": "You are concise."},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [weather_call]},
                {"role": "tool", "content": "Sunny, 21 C"},
                {"role": "assistant", "content": "Sunny and 21 C."},
            ],
            [WEATHER_TOOL],
        ),
        "tool_call_with_text_and_two_results": (
            [
                {"role": "user", "content": [img(p[3]), txt("Weather where this was taken, and in Rome?")]},
                {
                    "role": "assistant",
                    "content": "Let me check.",
                    "tool_calls": [
                        weather_call,
                        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
                    ],
                },
                {"role": "tool", "content": "Sunny"},
                {"role": "tool", "content": "Rain"},
                {"role": "assistant", "reasoning_content": "Two results.", "content": "Paris sunny, Rome rain."},
            ],
            [WEATHER_TOOL],
        ),
        "tools_without_call": (
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
            [WEATHER_TOOL],
        ),
        "json_argument_values": (
            [
                {"role": "user", "content": "Plan"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "type": "function",
                            "function": {"name": "plan", "arguments": {"steps": [1, 2], "opts": {"a": True}}},
                        }
                    ],
                },
                {"role": "tool", "content": "ok"},
                {"role": "assistant", "content": "Done."},
            ],
            None,
        ),
        "consecutive_assistants": (
            [
                {"role": "user", "content": "Count"},
                {"role": "assistant", "content": "One."},
                {"role": "assistant", "content": "Two."},
            ],
            None,
        ),
        "trailing_user_turn": (
            [
                {"role": "user", "content": "A"},
                {"role": "assistant", "content": "B"},
                {"role": "user", "content": [img(p[4]), txt("C")]},
            ],
            None,
        ),
        "unicode_and_whitespace": (
            [
                {"role": "user", "content": "  Grüße, 你好 😀 \n\n"},
                {"role": "assistant", "content": "\nΚαλημέρα — ok.  "},
            ],
            None,
        ),
        "image_in_assistant_turn": (
            [
                {"role": "user", "content": "Draw it"},
                {"role": "assistant", "content": [txt("Here: "), img(p[1]), txt(" done.")]},
            ],
            None,
        ),
        "same_image_twice": (
            [
                {"role": "user", "content": [img(p[0]), img(p[0]), txt("Same?")]},
                {"role": "assistant", "content": "Yes."},
            ],
            None,
        ),
        "image_url_block": (
            [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": p[1]}}, txt("Colour?")]},
                {"role": "assistant", "content": "Green."},
            ],
            None,
        ),
        "long_text": (
            [{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "many " * 200}],
            None,
        ),
    }
