"""The README's examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(code):
    exec(compile(code, str(README), "exec"), {})


def test_readme_has_exactly_two_setup_commands():
    bash = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    setup = [b for b in bash if "pip install" in b]
    assert len(setup) == 2 and "kernelplan bench" in setup[0] and "pytest" in setup[1]
