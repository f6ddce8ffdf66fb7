"""Build a tiny random-init causal LM and its tokenizer as a normal Hugging Face folder.

    python -m training.models.build_tiny --out DIR [--arch qwen3|llama] [--hidden 64] [--layers 2] [--weight-seed N]

The tokenizer is a byte-level BPE trained with ``tokenizers`` on a small generated corpus
(digits split one per token, ChatML special tokens, a chat template that renders tools).
Everything is deterministic for a given seed and needs no network. ``ensure_tiny_model()``
builds once into a cache folder and returns its path; ``ensure_tiny_model(weight_seed=1)`` is another
model with the same tokenizer (a distillation teacher for the tiny student, in the tests).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
from pathlib import Path

from training.utils.cache import cache_dir

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, Qwen-style: tools are listed in the system turn, tool calls are
# <tool_call>{json}</tool_call> in assistant text, tool results are user turns wrapped in
# <tool_response>. Every turn ends with <|im_end|>\n.
CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions. Function signatures:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    '</tools>\n\nCall a function with <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n'
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant\n{{ message.content or '' }}"
    "{% if message.tool_calls %}{% for tc in message.tool_calls %}"
    '<tool_call>\n{"name": "{{ tc.function.name }}", "arguments": '
    "{% if tc.function.arguments is string %}{{ tc.function.arguments }}{% else %}{{ tc.function.arguments | tojson }}{% endif %}"
    "}\n</tool_call>"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_WORDS = (
    "the a an is are was of to and in on for with what how many much plus minus times add "
    "subtract sum total answer question problem number apples books coins has have had gives "
    "left each more less than equal result calculator tool call function name arguments finish "
    "expression user assistant system you I it he she they we correct wrong try again please "
    "think step first then so because if not yes no value compute solve find"
).split()


def _corpus(seed: int, n: int = 4000) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice(["+", "-", "*"])
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12)))
        lines.append(
            f"{words} {a} {op} {b} = ? The answer is {a}. "
            f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{a}{op}{b}"}}}}</tool_call>'
            " <tool_response> </tool_response> <think> </think>"
        )
    return lines


def build_tokenizer(vocab_size: int = 512, seed: int = 0):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with ChatML special tokens and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model_config(
    vocab_size: int,
    arch: str = "qwen3",
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 4096,
    eos_token_id: int = 2,
    pad_token_id: int = 0,
):
    """A small ``transformers`` config of the given architecture."""
    from transformers import LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
    )
    if arch == "qwen3":
        return Qwen3Config(head_dim=hidden // heads, **common)
    if arch == "llama":
        return LlamaConfig(head_dim=hidden // heads, **common)
    raise ValueError(f"arch: {arch!r} is not one of ('qwen3', 'llama')")


def build_tiny(
    out: str | os.PathLike,
    arch: str = "qwen3",
    hidden: int = 64,
    layers: int = 2,
    vocab_size: int = 512,
    seed: int = 0,
    weight_seed: int | None = None,
) -> Path:
    """Write a tiny random-init model + tokenizer to ``out`` (atomically) and return the path.

    ``seed`` makes the tokenizer and, unless ``weight_seed`` is given, the weights."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out)
    tokenizer = build_tokenizer(vocab_size, seed)
    cfg = build_model_config(
        len(tokenizer),
        arch,
        hidden,
        layers,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed if weight_seed is None else weight_seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        GenerationConfig(eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id).save_pretrained(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the folder is a normal, shareable model folder
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def ensure_tiny_model(arch: str = "qwen3", weight_seed: int = 0) -> str:
    """Path of the cached tiny model of ``arch``, built on first use; ``weight_seed`` other than 0: the same
    architecture and tokenizer with other random weights (its own folder)."""
    path = cache_dir() / (f"tiny-{arch}" if weight_seed == 0 else f"tiny-{arch}-weights{weight_seed}")
    if not (path / "config.json").exists():
        build_tiny(path, arch=arch, weight_seed=weight_seed)
    return str(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--arch", default="qwen3", choices=["qwen3", "llama"])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weight-seed", type=int, default=None, help="seed of the weights (default: --seed)")
    a = p.parse_args()
    path = build_tiny(a.out, a.arch, a.hidden, a.layers, a.vocab_size, a.seed, a.weight_seed)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
