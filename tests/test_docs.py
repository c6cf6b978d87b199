"""The docs stay a guide: the README and benchmarks/README within their length, no git commit hashes in them, in
docs/ or in any module docstring, and every Markdown file the repository names exists inside it (no document
outside the repository is cited)."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEX = re.compile(r"\b[0-9a-f]{7,40}\b")


def _commits(text: str) -> list[str]:
    """Hex words of `text` that name a commit of this repository (words with a digit and a letter only)."""
    words = {w for w in HEX.findall(text) if re.search(r"\d", w) and re.search(r"[a-f]", w)}
    found = []
    for word in sorted(words):
        probe = subprocess.run(["git", "cat-file", "-t", word], cwd=ROOT, capture_output=True, text=True)
        if probe.stdout.strip() == "commit":
            found.append(word)
    return found


def _module_docstrings() -> dict[str, str]:
    out = {}
    for path in (ROOT / "verl").rglob("*.py"):
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        if doc:
            out[path.relative_to(ROOT).as_posix()] = doc
    return out


def test_readmes_are_guides_of_bounded_length():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 300
    assert len((ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8").splitlines()) <= 400
    assert (ROOT / "docs" / "architecture.md").is_file()


def test_no_commit_hashes_in_docs_or_module_docstrings():
    texts = {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8")
             for p in [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *(ROOT / "docs").glob("*.md")]}  # fmt: skip
    texts.update(_module_docstrings())
    assert {name: _commits(text) for name, text in texts.items() if _commits(text)} == {}


OUTPUTS = {"sweep.md", "notes.md"}  # files the code under test writes, not documents it cites


def test_every_markdown_file_named_is_in_the_repository():
    """A Markdown file named in code, tests or docs exists at that path (or, bare, somewhere in the repository)."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    names = {Path(p).name for p in tracked.split()} | {p for p in tracked.split()}
    missing = set()
    for path in [*ROOT.glob("verl/**/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("docs/*.md"), ROOT / "README.md"]:
        for ref in re.findall(r"[\w./-]*\b[\w-]+\.md\b", path.read_text(encoding="utf-8")):
            ref = ref.lstrip("./")
            if ref not in names and Path(ref).name not in names | OUTPUTS:
                missing.add(f"{path.relative_to(ROOT)}: {ref}")
    assert missing == set()
