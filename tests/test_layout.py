"""The suite's layout: pytest imports test modules by basename (no packages under tests/), so two
files of one name shadow each other, and worker processes spawned by a test unpickle the wrong one."""
from __future__ import annotations
from collections import Counter
from pathlib import Path


def test_every_test_module_has_its_own_basename() -> None:
    names = Counter(p.name for p in Path(__file__).parent.rglob("test_*.py"))
    assert [name for name, count in names.items() if count > 1] == []
