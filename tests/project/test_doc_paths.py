"""Every repository path the user docs name in backticks exists, so the docs stay true
when files move. Checked: README.md, benchmarks/README.md and every .md under docs/ (the
research notebook in docs/research/ included); a path counts
when its first component is a top-level entry of the repository (`memopd/ops/x.py`,
`tests/ops/`), or, in benchmarks/README.md, one of that folder's entries
(`results/…`). Outputs the docs name as what a command writes (`benchmarks/results/`
files that git ignores) and the `foo` of the "adding an op" recipe are not files of the
repository and are left out; brace lists (`ds_zero{2,3}.json`) and globs (`_C*.so`) are
expanded."""
import fnmatch
import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
TOP = {p.name for p in ROOT.iterdir() if not p.name.startswith(".") or p.name == ".ci"}
PLACEHOLDER = re.compile(r"(^|[/_])foo([._/]|$)|FOO|RUN_DIR|MODEL_DIR")


def _prose(text: str) -> str:
    """The text outside fenced code blocks (commands there are examples to run, with
    paths the user chooses)."""
    return re.sub(r"(?ms)^ *```.*?^ *```", "", text)


def _expand_braces(token: str) -> list[str]:
    m = re.search(r"\{([^{}]*,[^{}]*)\}", token)
    if not m:
        return [token]
    return list(itertools.chain.from_iterable(
        _expand_braces(token[:m.start()] + alt + token[m.end():]) for alt in m.group(1).split(",")))


def _ignored_output(rel: str) -> bool:
    """A file under benchmarks/results/ that its .gitignore does not keep: a benchmark's
    output, named as what a command writes."""
    if not rel.startswith("benchmarks/results/"):
        return False
    name = rel[len("benchmarks/results/"):].split("/")[0]
    if not name:
        return False  # the folder itself
    kept = [line[1:] for line in (ROOT / "benchmarks/results/.gitignore").read_text().splitlines()
            if line.startswith("!")]
    return not any(fnmatch.fnmatch(name, pattern) for pattern in kept)


def _named_paths(doc: Path) -> list[str]:
    """Relative repository paths in the doc's backtick spans, as written (a span may wrap
    onto the next line, as a long command does; it never crosses a blank line)."""
    out = []
    for span in re.findall(r"`([^`]+)`", _prose(doc.read_text())):
        if "\n\n" in span:
            continue
        for token in span.split():
            token = token.strip("\"'(),;[]").split("::")[0]
            token = re.sub(r":\d+(-\d+)?$", "", token)  # file.py:48
            if ("/" not in token or "://" in token or "=" in token or "(" in token or "..." in token
                    or token.endswith(".so") or PLACEHOLDER.search(token)):  # URLs, code, elisions, builds
                continue
            first = token.split("/")[0]
            if first in TOP or (doc.parent.name == "benchmarks" and (doc.parent / first).exists()
                                and first != ""):
                out.append(token)
            elif doc.parent.name == "benchmarks" and first == "results":
                out.append(token)
    return out


def _resolve(doc: Path, token: str) -> tuple[bool, str]:
    """Whether the token names something that exists, and its path from the root."""
    base = ROOT if token.split("/")[0] in TOP else doc.parent
    for alt in _expand_braces(token):
        rel = str((base / alt).relative_to(ROOT)) if "*" not in alt else str(base.relative_to(ROOT) / alt)
        rel = rel.lstrip("./") if rel.startswith("./") else rel
        if "*" in alt:
            if not list(ROOT.glob(rel)):
                return False, rel
            continue
        if _ignored_output(rel):
            continue
        if not (ROOT / rel).exists():
            return False, rel
    return True, token


@pytest.mark.parametrize("doc", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_named_paths_exist(doc):
    missing = sorted({rel for token in _named_paths(doc) for ok, rel in [_resolve(doc, token)] if not ok})
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: " + ", ".join(missing)


def test_the_check_sees_paths():
    """The extraction finds the paths it is meant to check (a regex that matched nothing
    would pass every doc)."""
    named = set(_named_paths(ROOT / "docs" / "design.md"))
    assert "memopd/ops/attention.py" in named and "kernels/contract.py" in named
    assert "memopd/ops/foo.py" not in named  # the recipe's placeholder
    research = ROOT / "docs" / "research" / "replication.md"
    assert research in DOCS and "trainer/experiments/ruleteacher.py" in _named_paths(research)
    assert "benchmarks/analysis/expert_departures.py" in _named_paths(research)  # a span wrapped onto two lines
    assert _resolve(ROOT / "README.md", "memopd/no_such_module.py") == (False, "memopd/no_such_module.py")
    assert _resolve(ROOT / "README.md", "trainer/configs/ds_zero{2,3}.json")[0]
