"""The README's Python examples run as written (docs that drift fail here), and
without a warning: a user who copies one should not be warned by our own lines. Every
relative link of the README, benchmarks/README.md and every .md under docs/ (files, images,
#anchors) resolves."""
import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
LINKED_DOCS = [README, ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


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


def _prose(text: str) -> str:
    """The text outside fenced code blocks (a link in code is an example, not a link)."""
    return re.sub(r"(?ms)^```.*?^```", "", text)


def _anchors(path: Path) -> set[str]:
    """GitHub's ids of the headings of a Markdown file: lower case, punctuation dropped
    (hyphens and underscores kept), spaces to hyphens."""
    out = set()
    for title in re.findall(r"(?m)^#{1,6} +(.+?) *$", _prose(path.read_text())):
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        out.add(slug)
    return out


def _links(path: Path) -> list[str]:
    return [t.split(" ")[0] for t in re.findall(r"\]\(([^)\s]+(?: \"[^\"]*\")?)\)", _prose(path.read_text()))]


def test_anchor_ids_follow_github():
    design = _anchors(ROOT / "docs" / "design.md")
    assert {"23-row-planning", "10-the-agent-environment", "11-invocation-one-model-call"} <= design
    assert "files-exit-codes-errors" in _anchors(README)


@pytest.mark.parametrize("doc", LINKED_DOCS, ids=[str(p.relative_to(ROOT)) for p in LINKED_DOCS])
def test_relative_links_resolve(doc):
    broken = []
    for target in _links(doc):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked offline
            continue
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


def test_cited_design_sections_exist():
    """`docs/design.md §N.M` in the docs and the code names a numbered heading there."""
    numbers = set(re.findall(r"(?m)^#{2,3} (\d+(?:\.\d+)?)[. ]", (ROOT / "docs" / "design.md").read_text()))
    sources = [*LINKED_DOCS]
    for folder, pattern in (("memopd", "*.py"), ("kernels", "*.py"), ("trainer", "*.py"), ("csrc", "*.cpp"),
                            ("benchmarks", "*.py"), ("tests", "*.py"), ("examples", "*.py")):
        sources += sorted((ROOT / folder).rglob(pattern))
    missing = []
    for path in sources:
        for cited in re.findall(r"design(?:\.md)? §(\d+(?:\.\d+)?)", path.read_text(errors="replace")):
            if cited not in numbers:
                missing.append(f"{path.relative_to(ROOT)}: §{cited}")
    assert not missing, "no such section in docs/design.md: " + ", ".join(sorted(set(missing)))
