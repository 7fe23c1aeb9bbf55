"""The documentation pages and what their code blocks hold: shell commands, TOML tables and relative links.

The README is the front door and ``docs/*.md`` hold one page per task; ``tests/test_readme_commands.py`` runs (or
names the test that runs) every command they show, and ``tests/test_docs.py`` validates every TOML block against the
config schema and resolves every relative link. The parsing lives here so that both, and the tests that run one
documented block as written (``block``), read the pages the same way.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import tomllib
from pathlib import Path

from pydantic import ValidationError

from vlm_sft.config import DEFAULT_CONFIG, REPO_ROOT, RunConfig, _explain, _merge

PAGES: tuple[Path, ...] = (REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md")))
"""Every page whose commands and TOML blocks must work: the README first, then the docs pages by name."""
LINKED_PAGES: tuple[Path, ...] = (*PAGES, REPO_ROOT / "bench" / "README.md")
"""Every page whose relative links must resolve."""

FENCE = re.compile(r"^```([\w-]*)[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
SHELL_LANGS = frozenset({"bash", "sh", "shell", "console"})
COMMAND_START = re.compile(r"^\s*(?:[A-Za-z_]\w*=\S*\s+)*(?:python3?|accelerate|torchrun|bash|sh|pip|uv|\.)\s")
"""A line that starts like a command: in a plain block that bash cannot parse, it means a broken command, not a
diagram."""


def page_name(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT))


# ---------------------------------------------------------------------------------------------------------------
# Shell blocks -> commands.


def _bash_parses(body: str) -> bool:
    return subprocess.run(["bash", "-n"], input=body, capture_output=True, text=True).returncode == 0


def _outside_quotes(line: str, pos: int) -> bool:
    """Whether ``pos`` is outside any quotes (the text before it splits as a complete shell line)."""
    try:
        shlex.split(line[:pos])
    except ValueError:
        return False
    return True


def _strip_comment(line: str) -> str:
    for m in re.finditer(r"(?:^|\s)#", line):
        if _outside_quotes(line, m.start()):
            return line[: m.start()]
    return line


def _split_and(line: str) -> list[str]:
    parts, start = [], 0
    for m in re.finditer(r"&&", line):
        if _outside_quotes(line, m.start()):
            parts.append(line[start : m.start()])
            start = m.end()
    return [p.strip() for p in [*parts, line[start:]] if p.strip()]


def block_commands(body: str) -> list[str]:
    """The commands of one shell block: continuations joined with one space, comments dropped, ``&&`` split."""
    joined = re.sub(r"[ \t]*\\\n[ \t]*", " ", body)
    commands: list[str] = []
    for line in joined.splitlines():
        commands += _split_and(_strip_comment(line).strip())
    return commands


def parse_page(text: str, page: str = "README.md") -> tuple[list[str], list[str]]:
    """(commands in page order, problems). ```bash blocks and plain ``` blocks that bash parses are commands; a
    plain block bash cannot parse is a diagram, unless a line of it starts like a command (then it is a problem).
    Blocks of any other language (``toml``, ``text``) are not commands."""
    commands: list[str] = []
    problems: list[str] = []
    for m in FENCE.finditer(text):
        lang, body = m.group(1).lower(), m.group(2)
        line_no = text.count("\n", 0, m.start()) + 1
        if lang and lang not in SHELL_LANGS:
            continue
        if not _bash_parses(body):
            if lang or any(COMMAND_START.match(line) for line in body.splitlines()):
                problems.append(f"{page}:{line_no}: this code block is not valid shell:\n{body}")
            continue
        commands += [c for c in block_commands(body) if c not in commands]
    return commands, problems


def pages_commands(pages: tuple[Path, ...] = PAGES) -> tuple[dict[str, list[str]], list[str]]:
    """({command: the pages showing it}, problems) over ``pages``, commands in page order."""
    where: dict[str, list[str]] = {}
    problems: list[str] = []
    for path in pages:
        commands, found = parse_page(path.read_text(), page_name(path))
        problems += found
        for command in commands:
            where.setdefault(command, []).append(page_name(path))
    return where, problems


def train_overrides(command: str) -> list[str] | None:
    """The ``--config`` and dotted overrides a ``vlm_sft/train.py`` command passes (``--dry-run`` and ``--help``
    left out), or None for any other command: they must load as a config, whether or not a test runs the command."""
    words = shlex.split(command)
    if "vlm_sft/train.py" not in words:
        return None
    return [w for w in words[words.index("vlm_sft/train.py") + 1 :] if w not in ("--dry-run", "--help")]


# ---------------------------------------------------------------------------------------------------------------
# TOML blocks -> validated configs.


def toml_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, body) of every ```toml block."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(2)) for m in FENCE.finditer(text) if m.group(1) == "toml"]


def toml_problem(body: str) -> str:
    """Empty when the block, laid over a config as a user would paste it into theirs, is a valid run config; else
    why not (an unknown key, a wrong type, a rejected combination). The config is ``configs/debug.toml``, or the one a
    first line ``# in configs/X.toml`` names. A block with ``[[data.sources]]`` replaces the base's single
    ``data.source``, as a mixture config does."""
    try:
        fragment = tomllib.loads(body)
    except tomllib.TOMLDecodeError as err:
        return f"not valid TOML: {err}"
    named = re.match(r"# in (configs/\S+\.toml)\s*\n", body)
    with (REPO_ROOT / named.group(1) if named else DEFAULT_CONFIG).open("rb") as f:
        base = tomllib.load(f)
    if "sources" in fragment.get("data", {}):
        base["data"].pop("source", None)
    try:
        RunConfig.model_validate(_merge(base, fragment))
    except ValidationError as err:
        return _explain(err)
    return ""


def block(lang: str, must_hold: str, pages: tuple[Path, ...] = PAGES) -> str:
    """The first ```lang block of the pages that contains ``must_hold``: a test that runs a documented example as
    written finds it wherever the page that shows it lives."""
    for path in pages:
        for m in FENCE.finditer(path.read_text()):
            if m.group(1) == lang and must_hold in m.group(2):
                return m.group(2)
    raise AssertionError(f"no ```{lang} block holding {must_hold!r} in {[page_name(p) for p in pages]}")


# ---------------------------------------------------------------------------------------------------------------
# Relative links.

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
"""``[text](target)`` and ``![alt](target)``; the target up to the first space or closing parenthesis."""


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lowercased, punctuation other than ``-`` and ``_`` dropped, spaces to ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())  # a linked heading keeps its text
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor in a markdown page (headings inside code blocks are not headings); repeated
    headings get ``-1``, ``-2``, ... as on GitHub."""
    outside = FENCE.sub("", text)
    seen: dict[str, int] = {}
    found: set[str] = set()
    for m in re.finditer(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", outside, re.M):
        slug = github_slug(m.group(1))
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found


def link_problems(path: Path, text: str | None = None) -> list[str]:
    """Every relative link of the page at ``path`` (its text, or ``text`` in its place) that does not resolve: a
    missing file or folder, or an ``#anchor`` that no heading of the target page has. Web links are not followed;
    code blocks and code spans hold no links."""
    text = path.read_text() if text is None else text
    prose = FENCE.sub(lambda b: "\n" * b.group(0).count("\n"), text)
    prose = re.sub(r"`[^`\n]*`", lambda c: " " * len(c.group(0)), prose)
    problems = []
    for m in LINK.finditer(prose):
        target = m.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        line_no = text.count("\n", 0, m.start()) + 1
        where = f"{path.name}:{line_no}: link {target!r}"
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            problems.append(f"{where}: {resolved} does not exist")
        elif anchor and resolved.suffix == ".md":
            page_text = text if resolved == path else resolved.read_text()
            if anchor not in anchors(page_text):
                problems.append(f"{where}: no heading #{anchor} in {resolved.name}")
    return problems
