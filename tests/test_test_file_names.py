"""Every test module's file name is unique: pytest imports them by basename (no ``__init__.py`` in the test
folders), and two of one name stop the collection of the whole suite ("import file mismatch")."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).parent


def test_test_module_basenames_are_unique():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    clashes = {name: sorted(str(p.relative_to(TESTS)) for p in TESTS.rglob(name)) for name, n in names.items() if n > 1}
    assert not clashes, f"rename one of each: {clashes}"
