"""Offline evaluation of a model on a task: pass@k and mean reward with a confidence interval."""
