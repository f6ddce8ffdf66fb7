"""vLLM worker extension: reload weights from disk and rebuild what vLLM's reload leaves stale.

Loaded inside vLLM's worker processes (``--worker-extension-cls
training.deployment.backends.vllm_worker.WeightReloadExtension``), so it must import with vLLM's venv
alone: it imports nothing from ``training`` and only ``torch`` / ``vllm`` lazily.
``scripts/setup_vllm.sh`` installs this package (without dependencies) into ``.venv-vllm``;
``VLLMDeployment`` also puts the repository on the server's ``PYTHONPATH``.

The pitfall it fixes (vLLM 0.32 CPU build): on CPU every linear layer keeps a prepacked copy of
its weight for its GEMM kernel (``layer.cpu_linear``), built in ``process_weights_after_loading``.
A model with tied embeddings has an output projection (``lm_head``, a ``ParallelLMHead``) whose
``weight`` *is* the input embedding's tensor. ``reload_weights`` writes the new embedding into
that tensor and re-processes the embedding layer, but ``lm_head`` receives no checkpoint tensor of
its own, so vLLM skips it and its prepacked copy keeps the *old* weights: logits are silently
computed with the old output projection. ``reload_weights_and_refresh`` reloads, then rebuilds the
CPU GEMM dispatch of every vocabulary-embedding layer (``VocabParallelEmbedding`` and its
subclass ``ParallelLMHead``) from the weight it now holds.

On GPU no prepacked copy exists (the kernel reads ``weight`` directly), so the refresh is a no-op
there.
"""

from __future__ import annotations

from typing import Any, Optional


class WeightReloadExtension:
    """Methods added to vLLM's worker class; call them with ``POST /collective_rpc``."""

    def reload_weights_and_refresh(self, weights_path: Optional[str] = None) -> dict[str, Any]:
        """``reload_weights(weights_path=...)`` then ``refresh_output_projections()``.

        Returns ``{"refreshed": [module names]}`` (JSON-friendly, for the RPC answer).
        """
        self.reload_weights(weights_path=weights_path, is_checkpoint_format=True)  # type: ignore[attr-defined]
        return {"refreshed": self.refresh_output_projections()}

    def refresh_output_projections(self) -> list[str]:
        """Rebuild the CPU GEMM dispatch (prepacked weight) of every vocab-embedding layer.

        Returns the names of the layers rebuilt (empty off CPU).
        """
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return []
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        refreshed = []
        for name, module in model.named_modules():
            if not isinstance(module, VocabParallelEmbedding) or not hasattr(module, "cpu_linear"):
                continue
            weight = getattr(module, "weight", None)
            if weight is None or weight.is_meta or weight.ndim != 2 or weight.numel() == 0:
                continue
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            refreshed.append(name)
        return refreshed

    def output_projection_checksum(self) -> dict[str, float]:
        """Sum of each vocab-embedding layer's ``weight`` (a cheap probe for tests and debugging)."""
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return {
            name: float(m.weight.double().sum())
            for name, m in model.named_modules()
            if isinstance(m, VocabParallelEmbedding) and getattr(m, "weight", None) is not None and not m.weight.is_meta
        }
