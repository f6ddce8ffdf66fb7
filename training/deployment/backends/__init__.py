"""The inference backends a run can deploy (embedded, vLLM, SGLang), the process lifecycle they share
(``process.py``), and the one table of what each can do (``registry.py``). See ../README.md."""
