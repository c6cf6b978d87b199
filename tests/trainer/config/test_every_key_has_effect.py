"""No config key of `ppo_trainer.yaml` is accepted without effect: each leaf key is refused at other values than
verl's (`key_policy.REFUSED`), listed as without effect with a notice (`key_policy.NO_EFFECT`), or its name is read
by code under verl/ (an attribute, keyword or name, or a word of a string that is not a docstring), else it is in
`READ_GENERICALLY` below with the code that reads it. The two policy tables and the type tables of checks.py do not
count as readers.
"""

from __future__ import annotations

import ast
import fnmatch
import re
from functools import lru_cache
from pathlib import Path

from verl.trainer.config.checks import _walk, default_config
from verl.trainer.config.key_policy import NO_EFFECT, REFUSED

VERL = Path(__file__).parents[3] / "verl"
NOT_READERS = {VERL / "trainer" / "config" / "key_policy.py", VERL / "trainer" / "config" / "checks.py"}

# Keys read without their name in the code: pattern -> the reader.
READ_GENERICALLY = {
    "*._target_": "Hydra's/verl's dataclass marker; omega_conf_to_dataclass ignores it here",
}


def _not_readers(tree: ast.AST) -> set[int]:
    """Nodes that name a key without reading it: docstrings, and the fields a (dataclass) class body declares."""
    ids = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if not isinstance(body, list):
            continue
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            ids.add(id(body[0].value))
        if isinstance(node, ast.ClassDef):
            ids.update(id(item.target) for item in body if isinstance(item, ast.AnnAssign))
    return ids


@lru_cache(maxsize=1)
def words_read_by_code() -> frozenset[str]:
    """Names read in verl/: attributes, variables and keywords, and the last part of each string that is a
    (dotted) identifier such as "gen_batch_size" or "reward_model.sandbox_fusion.url" (not words of messages)."""
    words: set[str] = set()
    for path in VERL.rglob("*.py"):
        if path in NOT_READERS:
            continue
        tree = ast.parse(path.read_text(), str(path))
        skip = _not_readers(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Attribute):
                words.add(node.attr)
            elif isinstance(node, ast.Name):
                words.add(node.id)
            elif isinstance(node, ast.keyword) and node.arg:
                words.add(node.arg)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if re.fullmatch(r"[A-Za-z_.][A-Za-z0-9_.]*", node.value):
                    words.add(node.value.rsplit(".", 1)[-1])
    return frozenset(words)


def _leaf_keys() -> list[str]:
    return [path for path, _ in _walk(default_config()) if not path.startswith(("hydra.", "defaults"))]


def _listed(path: str) -> bool:
    tables = (REFUSED, NO_EFFECT)
    if any(fnmatch.fnmatchcase(path, p) for table in tables for patterns in table.values() for p in patterns):
        return True
    return any(fnmatch.fnmatchcase(path, p) for p in READ_GENERICALLY)


def test_every_key_is_read_refused_or_listed_without_effect():
    words = words_read_by_code()
    silent = [path for path in _leaf_keys() if not _listed(path) and path.rsplit(".", 1)[-1] not in words]
    print("keys accepted without effect:", silent)
    assert not silent, silent


def test_the_scan_finds_what_it_should():
    """The checks above can fail: a made-up key is silent, a key read by one module only is found."""
    words = words_read_by_code()
    assert "no_such_config_key" not in words
    assert "gen_batch_size" in words  # read by the dynamic sampler and the legacy conversion, not only typed
    assert "use_legacy_worker_impl" not in words and _listed("trainer.use_legacy_worker_impl")
