"""How the engine runs its forward: the one choice of execution path (``build.py``), the lean forward
(``lean.py``) with its C decode step (``native.py``) and CUDA graphs, the transformers fallback (``hf.py``),
and what runs on a runner's weights and memory beside generation (``scoring.py``, ``sleep.py``)."""
