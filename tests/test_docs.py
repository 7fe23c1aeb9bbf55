"""The pages users read hold: every TOML block of README.md and docs/*.md is a valid config (unknown keys fail, as
the loader refuses them), and every relative link of those pages and of bench/README.md resolves, ``#anchor``
included. The commands are run or covered in ``tests/test_readme_commands.py``."""

from __future__ import annotations

import pytest
from doc_pages import (
    LINKED_PAGES,
    PAGES,
    anchors,
    block,
    github_slug,
    link_problems,
    page_name,
    toml_blocks,
    toml_problem,
)

from vlm_sft.config import REPO_ROOT

TOML_BLOCKS = [(page_name(p), line, body) for p in PAGES for line, body in toml_blocks(p.read_text())]


def test_the_pages_hold_toml_blocks():
    assert len(TOML_BLOCKS) >= 10, "the parser no longer finds the pages' ```toml blocks"


@pytest.mark.parametrize(("page", "line", "body"), TOML_BLOCKS, ids=[f"{p}:{n}" for p, n, _ in TOML_BLOCKS])
def test_every_toml_block_is_a_valid_config(page, line, body):
    problem = toml_problem(body)
    assert not problem, f"{page}:{line}: this TOML block is not a valid config:\n{problem}"


def test_a_misspelt_or_misplaced_setting_in_a_toml_block_fails():
    """Copies of documented blocks, each with one mistake a reader could copy: every one is refused, by name."""
    mixture = block("toml", "weight = 6")
    assert toml_problem(mixture) == ""
    assert "data.sources.0.wieght: unknown setting" in toml_problem(mixture.replace("weight = 6", "wieght = 6", 1))
    moe = block("toml", "ep_size = 8")
    assert "did you mean train.ep_size?" in toml_problem(moe.replace("ep_size", "ep_sise"))
    assert "model.ep_size" in toml_problem(moe.replace("[train]\n", ""))  # the right key in the wrong section
    assert "not valid TOML" in toml_problem("[data\nsource = 1\n")
    assert "data.packing" in toml_problem('[data]\npacking = "bdf"\n')


def test_github_slugs_match_the_headings_links_use():
    assert github_slug("Video per data worker (`bench_video.py`)") == "video-per-data-worker-bench_videopy"
    assert github_slug("Stop signals: save, then exit 143") == "stop-signals-save-then-exit-143"
    assert github_slug("`--dry-run`") == "--dry-run"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


@pytest.mark.parametrize("page", LINKED_PAGES, ids=page_name)
def test_every_relative_link_resolves(page):
    problems = link_problems(page)
    assert not problems, "\n".join(problems)


def test_a_broken_link_or_anchor_is_found(tmp_path):
    """A copy of the README in a folder of its own: its docs links now point nowhere; a link to an existing page
    with a heading it lacks, and a same-page anchor, are checked too."""
    readme = (REPO_ROOT / "README.md").read_text()
    copy = tmp_path / "README.md"
    copy.write_text(readme)
    assert any("docs/data.md" in p and "does not exist" in p for p in link_problems(copy))
    page = REPO_ROOT / "docs" / "video.md"
    text = "[ok](data.md#schemas) [bad](data.md#no-such-heading) [self](#videos) [gone](#nothing)\n# Videos\n"
    problems = link_problems(page, text)
    assert len(problems) == 2, problems
    assert "no heading #no-such-heading in data.md" in problems[0] and "no heading #nothing" in problems[1]
    assert link_problems(page, "[web](https://example.com/x) `[code](nowhere.md)`\n```\n[x](nowhere.md)\n```\n") == []
    assert link_problems(page, "\n[x](nowhere.md)") == [
        f"video.md:2: link 'nowhere.md': {page.parent / 'nowhere.md'} does not exist"
    ]
