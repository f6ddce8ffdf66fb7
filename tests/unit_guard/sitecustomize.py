"""Imported at start-up by every Python that a ``unit`` test starts (tests/conftest.py puts this folder first on
``PYTHONPATH`` while such a test runs): the unit guard in the child (refusals.py)."""

from refusals import install_in_child

install_in_child()
