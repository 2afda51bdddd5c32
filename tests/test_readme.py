"""The README's Python examples run as written (docs that drift fail here)."""
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_example_runs(i, capsys):
    exec(compile(BLOCKS[i], f"README.md python block {i}", "exec"), {"__name__": "__readme__"})
