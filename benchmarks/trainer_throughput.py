"""Trainer throughput: packing vs padding, shared-prompt packing vs ordinary packing, LoRA vs full fine-tuning,
bf16 autocast vs fp32.

    python -m benchmarks.trainer_throughput [--models tiny,smollm2] [--quick] [--parts packing,shared_prompt,lora,bf16]
        [--threads N]

Workload: one mixed-length batch of random token sequences (tiny: 16 sequences of 32..512 tokens;
SmolLM2: 8 of 16..192), the same loss on both sides: L = -sum(logprob of each token given its
prefix) / (trained tokens), i.e. a token-mean over every position but each sequence's first.
- packed: ``PolicyTrainer.forward_backward`` (no padding, per-sequence causal sdpa, chunked
  logprobs), ``micro_batch_tokens`` 4096;
- padded (baseline): plain ``AutoModelForCausalLM`` forward on one right-padded batch with an
  attention mask, full-vocabulary ``log_softmax``, the same loss.
Each variant runs in its own subprocess: trained tokens/s is the median of ``--repeats`` timed
forward+backward passes after one untimed first pass; peak memory is the growth of the process's
max RSS (``getrusage``) over that first pass, relative to the state after loading the model.
On a GPU the same would use ``torch.cuda.max_memory_allocated`` and report MFU (not measured here).

Shared-prompt packing: GRPO-shaped batches (groups of 8 completions of one random prompt; tiny: 4
groups, completions 64..192 tokens; SmolLM2: 1 group, 16..80), once with prompts about as long as
the completions and once 4x longer, the same loss. One process, one ``PolicyTrainer``; the shared
layout (``share_prefixes=True``, the default) and ordinary packing (the baseline) alternate pass
by pass, so both see the same load. Trained tokens/s = median of ``--repeats`` passes each after
the warm-up pair; the noise column is the range of the per-pair ratios, warm-up pair included.

LoRA: ``lora_rank=16`` (all linear layers) against full fine-tuning on the GRPO batch with prompts
as long as completions; a step is ``forward_backward`` + ``optim_step``. Step time: both trainers
in one process, steps alternating (full, LoRA, full, ...) after one untimed step each; median of
``--repeats`` steps, noise = range of per-pair ratios. Peak memory: each in its own process,
max-RSS growth over the first step (gradients, AdamW's state and activations appear there).

bf16: ``compute_dtype="bfloat16"`` (autocast, fp32 master weights and AdamW) against fp32 on the same
GRPO batch, a step being ``forward_backward`` + ``optim_step``, both trainers in one process, steps
alternating, median of ``--repeats`` after one untimed step each. Logprob gap: the example's
arithmetic questions (``training/examples/rl/arithmetic_smollm2/data.jsonl``, chat template), several
completions each sampled from the fp32 model at T = 1; both trainers score them (``logprobs``), and
the figures are the max and mean |Δ logprob| over the generated tokens.

``--threads N`` sets torch's thread count in every measuring process (default: torch's, one per core);
on a machine other jobs share, one thread per process keeps OpenMP threads from spinning against them.
"""

from __future__ import annotations

import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import base_parser, emit, median, model_path, row

SHAPES = {"tiny": (16, 32, 512), "smollm2": (8, 16, 192), "quick": (8, 16, 128)}
GRPO_SHAPES = {"tiny": (4, 8, 64, 192, 4096), "smollm2": (1, 8, 16, 80, 1024), "quick": (2, 4, 8, 24, 4096)}
"""(groups, completions per group, shortest and longest completion, micro_batch_tokens)."""
LORA_RANK = 16
BF16_SAMPLES = (8, 4, 48)
"""Gap of bf16 autocast: questions, completions sampled per question, new tokens per completion."""
EXAMPLE_ROWS = Path(__file__).resolve().parent.parent / "training/examples/rl/arithmetic_smollm2/data.jsonl"


def sequences(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def grpo_sequences(
    groups: int, size: int, lo: int, hi: int, prompt_ratio: int, vocab: int, seed: int = 0
) -> list[list[int]]:
    """``groups`` random prompts of ``prompt_ratio * (lo + hi) / 2`` tokens, each followed by ``size``
    completions of ``lo..hi`` tokens."""
    rng = random.Random(seed)
    prompt_len = prompt_ratio * (lo + hi) // 2
    out = []
    for _ in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        out += [prompt + [rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(size)]
    return out


def _max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def run_shared_prompt(path: str, shape: tuple[int, ...], prompt_ratio: int, repeats: int) -> dict:
    """Inside the subprocess: shared layout and ordinary packing, alternating, on one trainer."""
    from transformers import AutoConfig

    from training.trainer import PolicyTrainer
    from training.utils import TrainerConfig

    groups, size, lo, hi, micro_batch_tokens = shape
    vocab = min(AutoConfig.from_pretrained(path).vocab_size, 4000)
    seqs = grpo_sequences(groups, size, lo, hi, prompt_ratio, vocab)
    trained = sum(len(s) - 1 for s in seqs)
    trainer = PolicyTrainer(path, TrainerConfig(device="cpu", micro_batch_tokens=micro_batch_tokens))
    assert trainer.share_prefixes, "shared-prompt packing is not supported for this model"

    def loss_fn(packed, logprobs_N):
        return -logprobs_N.sum() / trained, {}

    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeats + 1):
        for share in (True, False):
            trainer.share_prefixes = share
            t0 = time.perf_counter()
            trainer.forward_backward(seqs, loss_fn)
            times[share].append(time.perf_counter() - t0)  # [0] is the warm-up pass: in the noise range only
            trainer.optimizer.zero_grad(set_to_none=True)
    computed = sum(len(s) for s in seqs) - (size - 1) * groups * (prompt_ratio * (lo + hi) // 2)
    return {
        "shared_tok_s": trained / median(times[True][1:]),
        "ordinary_tok_s": trained / median(times[False][1:]),
        "pair_ratios": [o / t for t, o in zip(times[True], times[False])],
        "tokens": trained,
        "computed_tokens": computed,
        "sequences": len(seqs),
    }


def run_variant(variant: str, path: str, shape: tuple[int, ...], repeats: int) -> dict:
    """Inside the subprocess: load, one first pass (memory), ``repeats`` timed passes."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    if variant in ("lora", "full"):
        return run_lora_variant(variant, path, shape, vocab)
    seqs = sequences(*shape, vocab=min(vocab, 4000))
    trained = sum(len(s) - 1 for s in seqs)
    if variant == "packed":
        from training.utils import TrainerConfig
        from training.trainer import PolicyTrainer

        trainer = PolicyTrainer(path, TrainerConfig(device="cpu", micro_batch_tokens=4096))

        def loss_fn(packed, logprobs_N):
            return -logprobs_N.sum() / trained, {}

        def step() -> None:
            trainer.forward_backward(seqs, loss_fn)
            trainer.optimizer.zero_grad(set_to_none=True)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
        model.train()
        width = max(len(s) for s in seqs)
        ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])

        def step() -> None:
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
            logprobs = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
            loss = -(logprobs * mask[:, 1:]).sum() / trained
            loss.backward()
            model.zero_grad(set_to_none=True)

    rss0 = _max_rss_mb()
    step()
    peak_mb = _max_rss_mb() - rss0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {
        "tok_s": trained / median(times),
        "peak_mb": peak_mb,
        "tokens": trained,
        "padded_tokens": len(seqs) * max(len(s) for s in seqs),
    }


def _lora_trainer(variant: str, path: str, micro_batch_tokens: int):
    from training.trainer import PolicyTrainer
    from training.utils import TrainerConfig

    rank = LORA_RANK if variant == "lora" else 0
    return PolicyTrainer(
        path, TrainerConfig(device="cpu", micro_batch_tokens=micro_batch_tokens, lora_rank=rank, learning_rate=1e-6)
    )


def _optimizer_step(trainer, seqs: list[list[int]], trained: int) -> None:
    trainer.forward_backward(seqs, lambda packed, logprobs_N: (-logprobs_N.sum() / trained, {}))
    trainer.optim_step()


def run_lora_variant(variant: str, path: str, shape: tuple[int, ...], vocab: int) -> dict:
    """Peak memory of one optimizer step (``forward_backward`` + ``optim_step``), LoRA or full fine-tuning."""
    groups, size, lo, hi, micro_batch_tokens = shape
    seqs = grpo_sequences(groups, size, lo, hi, 1, vocab=min(vocab, 4000))
    trained = sum(len(s) - 1 for s in seqs)
    trainer = _lora_trainer(variant, path, micro_batch_tokens)
    rss0 = _max_rss_mb()
    _optimizer_step(trainer, seqs, trained)
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    return {"peak_mb": _max_rss_mb() - rss0, "tokens": trained, "trainable": trainable}


def run_lora_timing(path: str, shape: tuple[int, ...], repeats: int) -> dict:
    """Step time of full fine-tuning and LoRA, both trainers in this process, steps alternating."""
    from transformers import AutoConfig

    groups, size, lo, hi, micro_batch_tokens = shape
    seqs = grpo_sequences(groups, size, lo, hi, 1, vocab=min(AutoConfig.from_pretrained(path).vocab_size, 4000))
    trained = sum(len(s) - 1 for s in seqs)
    trainers = {v: _lora_trainer(v, path, micro_batch_tokens) for v in ("full", "lora")}
    times: dict[str, list[float]] = {"full": [], "lora": []}
    for k in range(repeats + 1):
        for v, trainer in trainers.items():
            t0 = time.perf_counter()
            _optimizer_step(trainer, seqs, trained)
            if k > 0:  # the first step of each is a warm-up (AdamW's state is created there)
                times[v].append(time.perf_counter() - t0)
    return {
        "full_s": median(times["full"]),
        "lora_s": median(times["lora"]),
        "pair_ratios": [b / a for a, b in zip(times["full"], times["lora"])],
        "tokens": trained,
    }


def sample_sequences(
    model, tokenizer, questions: list[str], n: int, max_new: int, seed: int = 0
) -> tuple[list[list[int]], list[int]]:
    """Per question: its chat-template prompt followed by each of ``n`` completions sampled at T = 1 (KV cache,
    no ``generate``), cut after the first end-of-sequence token. Returns the ``prompt + completion`` id lists and
    their prompt lengths."""
    from transformers import DynamicCache

    generator = torch.Generator().manual_seed(seed)
    out, prompt_lens = [], []
    for question in questions:
        messages = [{"role": "user", "content": question}]
        prompt = list(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
        cache = DynamicCache(config=model.config)
        new = []
        with torch.no_grad():
            logits = model(torch.tensor([prompt] * n), cache=cache, use_cache=True).logits[:, -1]
            for _ in range(max_new):
                token = torch.multinomial(logits.float().softmax(-1), 1, generator=generator)
                new.append(token)
                logits = model(token, cache=cache, use_cache=True).logits[:, -1]
        for completion in torch.cat(new, 1).tolist():
            if tokenizer.eos_token_id in completion:
                completion = completion[: completion.index(tokenizer.eos_token_id) + 1]
            out.append(prompt + completion)
            prompt_lens.append(len(prompt))
    return out, prompt_lens


def run_bf16(path: str, shape: tuple[int, ...], repeats: int) -> dict:
    """Inside the subprocess: step time of fp32 and bf16 autocast (steps alternating), then the logprob gap."""
    from transformers import AutoConfig

    from training.trainer import PolicyTrainer
    from training.utils import TrainerConfig

    groups, size, lo, hi, micro_batch_tokens = shape
    seqs = grpo_sequences(groups, size, lo, hi, 1, vocab=min(AutoConfig.from_pretrained(path).vocab_size, 4000))
    trained = sum(len(s) - 1 for s in seqs)
    trainers = {
        dtype: PolicyTrainer(
            path,
            TrainerConfig(device="cpu", micro_batch_tokens=micro_batch_tokens, learning_rate=1e-6, compute_dtype=dtype),
        )
        for dtype in ("float32", "bfloat16")
    }
    times: dict[str, list[float]] = {dtype: [] for dtype in trainers}
    for k in range(repeats + 1):
        for dtype, trainer in trainers.items():
            t0 = time.perf_counter()
            _optimizer_step(trainer, seqs, trained)
            if k > 0:  # the first step of each is a warm-up (AdamW's state, oneDNN's bf16 kernels)
                times[dtype].append(time.perf_counter() - t0)
    n_questions, n, max_new = BF16_SAMPLES
    questions = [json.loads(line)["question"] for line in EXAMPLE_ROWS.read_text().splitlines()[:n_questions]]
    fp32 = trainers["float32"]
    samples, prompt_lens = sample_sequences(fp32.model, fp32.tokenizer, questions, n, max_new)
    scored = {dtype: trainer.logprobs(samples) for dtype, trainer in trainers.items()}
    gaps = [
        abs(a - b)
        for p, la, lb in zip(prompt_lens, scored["float32"], scored["bfloat16"])
        for a, b in zip(la[p:], lb[p:])
    ]
    return {
        "fp32_s": median(times["float32"]),
        "bf16_s": median(times["bfloat16"]),
        "pair_ratios": [b / a for a, b in zip(times["float32"], times["bfloat16"])],
        "tokens": trained,
        "gap_max": max(gaps),
        "gap_mean": sum(gaps) / len(gaps),
        "gap_tokens": len(gaps),
    }


def _spread(ratios: list[float]) -> str:
    """The range of per-pair ratios of interleaved passes: how much the load moved the figure."""
    return f"pair ratios {min(ratios):.3g}..{max(ratios):.3g} (n={len(ratios)})"


def measure(
    variant: str, path: str, shape: tuple[int, ...], repeats: int, prompt_ratio: int = 1, threads: int = 0
) -> dict:
    """Run one variant in a fresh subprocess (so its max RSS is its own); ``threads`` 0 = torch's default."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.trainer_throughput",
            "--variant",
            variant,
            "--path",
            path,
            "--shape",
            ",".join(map(str, shape)),
            "--repeats",
            str(repeats),
            "--prompt-ratio",
            str(prompt_ratio),
            "--threads",
            str(threads),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{variant} subprocess failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--models", default="tiny,smollm2")
    p.add_argument(
        "--variant",
        choices=["packed", "padded", "shared_prompt", "lora_time", "lora", "full", "bf16"],
        help="internal: run one variant and print its result",
    )
    p.add_argument("--path")
    p.add_argument("--shape")
    p.add_argument("--prompt-ratio", type=int, default=1)
    p.add_argument("--parts", default="packing,shared_prompt,lora,bf16", help="which comparisons to run")
    p.add_argument("--threads", type=int, default=0, help="torch threads per measuring process (0: torch's default)")
    a = p.parse_args()
    parts = set(a.parts.split(","))
    if a.variant:
        if a.threads:
            torch.set_num_threads(a.threads)
        shape = tuple(int(x) for x in a.shape.split(","))
        if a.variant == "bf16":
            result = run_bf16(a.path, shape, a.repeats)
        elif a.variant == "shared_prompt":
            result = run_shared_prompt(a.path, shape, a.prompt_ratio, a.repeats)
        elif a.variant == "lora_time":
            result = run_lora_timing(a.path, shape, a.repeats)
        else:
            result = run_variant(a.variant, a.path, shape, a.repeats)
        print(json.dumps(result))
        return
    started = time.perf_counter()
    rows = []
    for name in ["tiny"] if a.quick else a.models.split(","):
        shape = SHAPES["quick"] if a.quick else SHAPES.get(name, SHAPES["smollm2"])
        path = model_path(name)
        if "packing" in parts:
            packed = measure("packed", path, shape, a.repeats, threads=a.threads)
            padded = measure("padded", path, shape, a.repeats, threads=a.threads)
            desc = (
                f"{name}: {shape[0]} seqs of {shape[1]}..{shape[2]} tokens ({packed['tokens']} trained, "
                f"{packed['padded_tokens']} padded)"
            )
            rows.append(row(f"{desc}, packed", packed["tok_s"], "trained tok/s", "padded HF forward", padded["tok_s"]))
            rows.append(
                row(f"{desc}, packed", packed["peak_mb"], "peak extra RSS MB", "padded HF forward", padded["peak_mb"])
            )
        grpo = GRPO_SHAPES["quick"] if a.quick else GRPO_SHAPES.get(name, GRPO_SHAPES["smollm2"])
        for ratio in (1, 4) if "shared_prompt" in parts else ():
            m = measure("shared_prompt", path, grpo, a.repeats, prompt_ratio=ratio, threads=a.threads)
            desc = (
                f"{name}: GRPO {grpo[0]} groups x {grpo[1]}, prompt {ratio}x completion ({m['tokens']} trained, "
                f"{m['computed_tokens']} computed), shared-prompt packing"
            )
            rows.append(
                row(
                    desc,
                    m["shared_tok_s"],
                    "trained tok/s",
                    "ordinary packing",
                    m["ordinary_tok_s"],
                    noise=_spread(m["pair_ratios"]),
                )
            )
        if "lora" in parts and (name == "smollm2" or a.quick):
            timing = measure("lora_time", path, grpo, a.repeats, threads=a.threads)
            memory = {v: measure(v, path, grpo, 0, threads=a.threads) for v in ("full", "lora")}
            desc = (
                f"{name}: GRPO {grpo[0]} groups x {grpo[1]} ({timing['tokens']} trained), "
                f"LoRA r={LORA_RANK} ({memory['lora']['trainable']} of {memory['full']['trainable']} trainable)"
            )
            rows.append(
                row(
                    f"{desc}, step time",
                    timing["lora_s"],
                    "s per optimizer step (lower is better)",
                    "full fine-tuning",
                    timing["full_s"],
                    noise=_spread(timing["pair_ratios"]),
                )
            )
            rows.append(
                row(
                    f"{desc}, step memory",
                    memory["lora"]["peak_mb"],
                    "peak extra RSS MB",
                    "full fine-tuning",
                    memory["full"]["peak_mb"],
                )
            )
        if "bf16" in parts and (name == "smollm2" or a.quick):
            m = measure("bf16", path, grpo, a.repeats, threads=a.threads)
            desc = f"{name}: GRPO {grpo[0]} groups x {grpo[1]} ({m['tokens']} trained), bf16 autocast"
            rows.append(
                row(
                    f"{desc}, step time",
                    m["bf16_s"],
                    "s per optimizer step (lower is better)",
                    "fp32",
                    m["fp32_s"],
                    noise=_spread(m["pair_ratios"]),
                )
            )
            for stat in ("max", "mean"):
                rows.append(
                    row(
                        f"{desc}, {stat} |Δ logprob| vs fp32 over {m['gap_tokens']} sampled tokens",
                        m[f"gap_{stat}"],
                        "logprob (lower is better)",
                        "fp32 (0 by definition)",
                        0.0,
                    )
                )
    emit(
        "trainer_throughput",
        rows,
        notes="GPU rows (peak CUDA memory, MFU): not measured, no GPU lent to this task.",
        started=started,
        repeats=a.repeats,
    )


if __name__ == "__main__":
    main()
