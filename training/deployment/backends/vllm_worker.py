"""vLLM worker extension: reload weights from disk or receive them over a process group, and rebuild what
vLLM's reload leaves stale.

Loaded inside vLLM's worker processes (``--worker-extension-cls
training.deployment.backends.vllm_worker.WeightReloadExtension``), so it must import with vLLM's venv
alone: at module level it imports nothing; its methods import ``torch`` / ``vllm`` and, for the
distributed push, the protocol of ``training/deployment/weights/distributed.py`` (store keys, the group,
``weights/buckets.py``'s plan: torch and the standard library only), lazily.
``scripts/setup_vllm.sh`` installs this package (without dependencies) into ``.venv-vllm``;
``VLLMDeployment`` also puts the repository on the server's ``PYTHONPATH``.

Distributed push (``VLLMWeightSender``, ``backends/vllm_weights.py``, drives these through ``POST
/collective_rpc``; every worker of the server is one member of the trainer's group):

- ``weight_worker_rank()``: this worker's rank in vLLM (the answer's length counts the members);
- ``join_weight_group(master_addr, master_port, rank, world_size, backend, timeout_s)``: member
  ``rank + worker rank`` joins the group the trainer hosts (gloo on CPU, NCCL with the weights on GPUs);
- ``receive_weights(names, dtypes, shapes, bucket_bytes, update_id)``: the metadata is checked against
  the served checkpoint (names, shapes; a refusal moves nothing), then accepted through the store; after the
  trainer's go each bucket is received into a fresh buffer and fed, as checkpoint-format tensors, to vLLM's
  in-place ``reload_weights(weights_iterator=...)`` (layer by layer: the tensors vLLM serves are written in
  place, the CPU GEMM's prepacked copies rebuilt), then the tied output projection is refreshed as below.
  A failure after the go drains the rest of the stream (the trainer is never left hanging) and answers
  ``{"error", "loaded"}``.

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

from typing import Any, Iterator, Optional


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

    # ------------------------------------------------------------------ the distributed push
    def weight_worker_rank(self) -> int:
        """This worker's rank among the server's workers (``collective_rpc`` answers one per member)."""
        return int(self.rank)  # type: ignore[attr-defined]

    def join_weight_group(
        self, master_addr: str, master_port: int, rank: int, world_size: int, backend: str, timeout_s: float
    ) -> dict[str, Any]:
        """Join the trainer's group as member ``rank + worker rank`` (blocks until every member joined)."""
        import datetime

        import torch.distributed as dist

        from training.deployment.weights.distributed import gloo_bind_addr, joined_key, make_process_group

        self.leave_weight_group()
        member = int(rank) + int(self.rank)  # type: ignore[attr-defined]
        store = dist.TCPStore(
            master_addr, int(master_port), int(world_size), is_master=False,
            timeout=datetime.timedelta(seconds=float(timeout_s)),
        )  # fmt: skip
        store.set(joined_key(member), b"1")
        pg = make_process_group(
            store, member, int(world_size), backend, float(timeout_s), gloo_bind_addr(master_addr, master_port, backend)
        )
        self._weight_group = {"store": store, "pg": pg, "rank": member, "backend": backend}
        return {"rank": member}

    def leave_weight_group(self) -> None:
        """Drop this worker's group (a new trainer may join it again)."""
        group = getattr(self, "_weight_group", None)
        self._weight_group = None
        if group is not None and hasattr(group["pg"], "shutdown"):
            try:
                group["pg"].shutdown()
            except Exception:  # peers already gone
                pass

    def receive_weights(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], bucket_bytes: int, update_id: str
    ) -> dict[str, Any]:
        """One update of the trainer's broadcast (module docstring). Raises ``ValueError`` naming the field for
        metadata it refuses (nothing moved); returns ``{"loaded", "received_bytes", "refreshed"}``, or with
        ``"error"`` when receiving or loading failed after the go (the served weights may then be a mix)."""
        from training.deployment.weights.distributed import DTYPES, accept_key, go_key

        group = getattr(self, "_weight_group", None)
        if group is None:
            raise ValueError("receive_weights: this worker has joined no weight group (join_weight_group first)")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
            raise ValueError("names, dtypes, shapes: must be lists")
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"names, dtypes, shapes: unequal lengths {len(names)}, {len(dtypes)}, {len(shapes)}")
        for i, dt in enumerate(dtypes):
            if not isinstance(dt, str) or dt not in DTYPES:
                raise ValueError(f"dtypes[{i}]: {dt!r} is not one of {sorted(DTYPES)}")
        self._check_against_checkpoint(names, shapes)
        plan = ([str(n) for n in names], [DTYPES[d] for d in dtypes], [tuple(int(d) for d in s) for s in shapes])
        store, rank = group["store"], group["rank"]
        store.set(accept_key(update_id, rank), b"ok")
        if store.get(go_key(update_id)) != b"go":
            return {"loaded": 0, "received_bytes": 0, "refreshed": [], "aborted": True}
        stats = {"loaded": 0, "received_bytes": 0}
        stream = self._received_tensors(group, plan, int(bucket_bytes), stats)
        try:
            self.reload_weights(weights_iterator=stream, is_checkpoint_format=True)  # type: ignore[attr-defined]
        except Exception as e:
            for _ in stream:  # keep the collective in step: receive (and drop) the rest
                pass
            self._finish_failed_reload()
            return {**stats, "refreshed": [], "error": f"{type(e).__name__}: {e}"}
        for _ in stream:  # vLLM stopped early (it never should): drain, so the trainer finishes
            pass
        return {**stats, "refreshed": self.refresh_output_projections()}

    def _received_tensors(
        self, group: dict, plan: tuple[list, list, list], bucket_bytes: int, stats: dict
    ) -> Iterator[tuple[str, Any]]:
        """(checkpoint name, tensor) pairs as the buckets arrive; each bucket gets a fresh buffer, because vLLM's
        layerwise reload may hold a tensor until the rest of its layer arrives."""
        import torch

        from training.deployment.weights.buckets import plan_buckets
        from training.deployment.weights.distributed import broadcast_from_trainer, sync_device

        names, dtypes, shapes = plan
        device = self.device if group["backend"] == "nccl" else torch.device("cpu")  # type: ignore[attr-defined]
        for bucket in plan_buckets(dtypes, shapes, bucket_bytes):
            numels = [torch.Size(shapes[i]).numel() for i in bucket]
            buf = torch.empty(sum(numels), dtype=dtypes[bucket[0]], device=device)
            broadcast_from_trainer(group["pg"], buf, sync=False)
            sync_device(device)
            stats["received_bytes"] += buf.numel() * buf.element_size()
            offset = 0
            for i, n in zip(bucket, numels):
                stats["loaded"] += 1
                yield names[i], buf[offset : offset + n].view(shapes[i])
                offset += n

    def _finish_failed_reload(self) -> None:
        """After a reload that raised half-way: put the layers vLLM was still waiting on back on their tensors."""
        try:
            from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

            finalize_layerwise_reload(self.model_runner.get_model(), self.model_config)  # type: ignore[attr-defined]
        except Exception:
            pass

    def _check_against_checkpoint(self, names: list, shapes: list) -> None:
        """Refuse (``ValueError`` naming the field) a name the served checkpoint lacks, a shape that differs from
        it, or a missing tensor (a full set, as on every path; a tied ``lm_head.weight`` may be left out). Skipped
        when the model is no local folder of safetensors (a hub id: vLLM refuses unknown names itself)."""
        import glob
        import os

        from safetensors import safe_open

        folder = str(self.model_config.model)  # type: ignore[attr-defined]
        files = sorted(glob.glob(os.path.join(folder, "*.safetensors"))) if os.path.isdir(folder) else []
        if not files:
            return
        expected: dict[str, list[int]] = {}
        for path in files:
            with safe_open(path, "pt") as f:
                for key in f.keys():
                    expected[key] = list(f.get_slice(key).get_shape())
        seen = set()
        for i, (name, shape) in enumerate(zip(names, shapes)):
            if not isinstance(name, str) or name not in expected:
                raise ValueError(f"names[{i}]: {name!r} is not a tensor of the served checkpoint")
            if name in seen:
                raise ValueError(f"names[{i}]: {name!r} appears twice")
            seen.add(name)
            if not isinstance(shape, list) or [int(d) for d in shape] != expected[name]:
                raise ValueError(f"shapes[{i}]: {shape} for {name!r} does not match the checkpoint's {expected[name]}")
        tied = bool(getattr(self.model_config.hf_config, "tie_word_embeddings", False))  # type: ignore[attr-defined]
        missing = sorted(set(expected) - seen - ({"lm_head.weight"} if tied else set()))
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ValueError(f"names: {missing[0]!r} is missing{more}; a full set is required")
