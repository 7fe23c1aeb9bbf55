"""The README is the front door: its two commands must be the ones CI and users run."""

from __future__ import annotations

import re

from vlm_sft.config import REPO_ROOT


def _bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_ci_runs_exactly_the_readme_test_command():
    readme = (REPO_ROOT / "README.md").read_text()
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    test_cmd = next(b for b in _bash_blocks(readme) if "pytest" in b)
    assert test_cmd in ci.splitlines()


def test_readme_main_command_runs_the_default_config():
    readme = (REPO_ROOT / "README.md").read_text()
    main_cmd = _bash_blocks(readme)[0]
    assert main_cmd.endswith("accelerate launch vlm_sft/train.py")
    assert (REPO_ROOT / "configs" / "debug.toml").is_file()
