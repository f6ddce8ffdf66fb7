"""A ``train.py`` command line prints a user error in one line and keeps other errors' tracebacks (user_errors.py).

Each case is a small script in a subprocess that calls ``apply_overrides`` (as every ``train.py`` does) and raises.
"""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = """
import dataclasses
from training.utils.cli import apply_overrides
from training.utils.config import ConfigError

@dataclasses.dataclass
class Cfg:
    lr: float = 1.0

cfg = apply_overrides(Cfg())
raise {error}
"""


def run(error: str, *argv: str) -> subprocess.CompletedProcess:
    code = textwrap.dedent(SCRIPT.format(error=error))
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "error, line",
    [
        ('ConfigError("lr: must be positive")', "run stopped: lr: must be positive (--debug shows the traceback)"),
        (
            "ImportError('verifiers is not installed: pip install -e \".[verifiers]\"')",
            'run stopped: verifiers is not installed: pip install -e ".[verifiers]" (--debug shows the traceback)',
        ),
    ],
)
def test_a_user_error_is_one_line_and_debug_shows_its_traceback(error, line):
    proc = run(error)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [line]
    debug = run(error, "--debug", "lr=2.0")
    assert debug.returncode == 1 and "Traceback" in debug.stderr and line not in debug.stderr


@pytest.mark.parametrize(
    "error",
    ['ValueError("a bug in the library")', "ImportError(\"cannot import name 'x'\", name='training.utils.run_record')"],
)
def test_a_bug_keeps_its_traceback(error):
    """A name missing from the library's own module is a bug or a broken install, not an extra to install."""
    proc = run(error)
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "run stopped" not in proc.stderr
