"""The README's Python examples run as written (docs that drift fail here), and
without a warning: a user who copies one should not be warned by our own lines."""
import re
import warnings
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_readme_example_runs(i, capsys):
    code = compile(BLOCKS[i], f"README.md python block {i}", "exec")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # third-party import-time notices are not the example's doing
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"(?!__readme__)")
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"(?!__readme__)")
        exec(code, {"__name__": "__readme__"})
