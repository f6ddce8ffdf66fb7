"""``python -m training.eval``: see ``training/eval/cli.py`` and training/eval/README.md."""

from training.eval.cli import main

raise SystemExit(main())
