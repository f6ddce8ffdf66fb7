"""SGLang as the deployment engine: launch or attach, token-level sampling, weight sync.

Untested on these CPU-only machines (SGLang needs a GPU); the request building and response
parsing are unit-tested against the shapes in SGLang's documentation, and
``tests/deployment/test_sglang.py::test_real_server`` runs against a real server on a GPU machine
(command in training/deployment/README.md).

- ``SGLangDeployment(model, cfg)``: a ``ServerProcess`` like ``EmbeddedDeployment``. Launches
  ``python -m sglang.launch_server --model-path DIR --host 127.0.0.1 --port N ...`` (the Python of
  ``cfg.engine_python``) or attaches to ``cfg.base_url``.
- ``SGLangSampler``: a ``DeploymentSampler`` whose token-level calls go to SGLang's native
  ``POST /generate`` (``input_ids`` in; ``return_logprob: true`` gives
  ``meta_info.output_token_logprobs`` = ``[[logprob, token_id, text], ...]``,
  ``meta_info.finish_reason = {"type": "stop" | "length" | "abort", ...}`` and
  ``meta_info.weight_version``). SGLang's OpenAI ``/v1/completions`` returns text and logprobs
  but not the sampled token ids in every version, so ``/generate`` is the exact path. ``chat``
  renders the messages with the model's chat template locally (``tokenizer=``) and generates
  from the ids, so the trainer trains on exactly the ids that were sampled.
- Weight sync from disk: ``POST /update_weights_from_disk`` with ``{"model_path": DIR,
  "weight_version": "V"}``. SGLang takes a writer lock that waits for in-flight requests
  (what ``wait_for_inflight=True`` means here); with ``wait_for_inflight=False`` the sync first
  calls ``/pause_generation`` with ``mode="retract"`` (in-flight requests go back to the queue and
  are recomputed on the new weights) and ``/continue_generation`` after.
- The distributed path (NCCL, trainer and server on GPUs): ``/init_weights_update_group`` once,
  then per sync ``/update_weights_from_distributed`` with the tensors' names, dtypes and shapes
  while the trainer broadcasts each tensor from rank 0 of that group. ``distributed_init_body``
  and ``distributed_update_body`` build those requests; the trainer-side broadcast is not wired.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from training.deployment.server.bodies import parse_tool_calls
from training.deployment.client import Completion, DeploymentRequestError, DeploymentSampler
from training.deployment.backends.process import ServerProcess
from training.deployment.weights.files import WeightSyncError
from training.openai_api.tool_parsers import select_tool_parser
from training.utils.config import DeployConfig

log = logging.getLogger(__name__)

# OpenAI-style sampling names -> SGLang ``sampling_params`` names (the rest are refused by name).
SAMPLING_NAMES = {
    "max_tokens": "max_new_tokens",
    "max_new_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "seed": "sampling_seed",
    "min_tokens": "min_new_tokens",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "skip_special_tokens": "skip_special_tokens",
}
IGNORED_NAMES = ("logprobs", "return_token_ids", "model", "n")
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}
CONFIG_FILES = ("config.json", "generation_config.json")


def model_file(model: str, name: str) -> Optional[Path]:
    """``name`` of ``model`` (a folder, or a hub id resolved by transformers' ``cached_file``); None if absent."""
    local = Path(model) / name
    if local.is_file():
        return local
    if Path(model).is_dir():
        return None
    from transformers.utils import cached_file

    found = cached_file(
        model, name, _raise_exceptions_for_missing_entries=False, _raise_exceptions_for_connection_errors=False
    )
    return Path(found) if found else None


def sglang_sampling_params(sampling: dict, *, seed_offset: int = 0) -> dict:
    """Map OpenAI-style sampling kwargs to SGLang ``sampling_params``; unknown names raise ValueError."""
    out: dict[str, Any] = {}
    for key, value in sampling.items():
        if key in IGNORED_NAMES or value is None:
            continue
        if key not in SAMPLING_NAMES:
            raise ValueError(f"sampling: {key!r} has no SGLang equivalent; known: {sorted(SAMPLING_NAMES)}")
        out[SAMPLING_NAMES[key]] = value
    if "sampling_seed" in out:
        out["sampling_seed"] = int(out["sampling_seed"]) + seed_offset
    if isinstance(out.get("stop"), str):
        out["stop"] = [out["stop"]]
    return out


def build_generate_request(prompt_ids: Sequence[int], n: int, sampling: dict) -> dict:
    """The ``/generate`` body for ``n`` samples of one token-id prompt (a batch of ``n`` copies;
    with a ``seed``, copy ``i`` uses ``seed + i``)."""
    if not prompt_ids:
        raise ValueError("prompt_ids: must not be empty")
    if n < 1:
        raise ValueError(f"n: must be >= 1, got {n}")
    ids = [int(t) for t in prompt_ids]
    params = [sglang_sampling_params(sampling, seed_offset=i) for i in range(n)]
    return {"input_ids": [ids] * n, "sampling_params": params, "return_logprob": True, "logprob_start_len": -1}


def _version(meta: dict, sent_under: int) -> int:
    """SGLang's ``weight_version`` is a string ("default" before any update): ints are trusted."""
    v = meta.get("weight_version")
    try:
        return int(v)
    except (TypeError, ValueError):
        return sent_under


def parse_generate_item(prompt_ids: Sequence[int], item: dict, *, sent_under: int = 0, url: str = "") -> Completion:
    """One ``/generate`` answer as a ``Completion`` (errors name what is missing)."""
    if not isinstance(item, dict) or "meta_info" not in item:
        raise DeploymentRequestError(f"SGLang /generate answer has no meta_info: {str(item)[:300]}", url=url)
    meta = item["meta_info"]
    lps = meta.get("output_token_logprobs")
    if lps is None:
        raise DeploymentRequestError(
            "SGLang returned no meta_info.output_token_logprobs (needs return_logprob)", url=url
        )
    tokens = [int(x[1]) for x in lps]
    if item.get("output_ids") is not None and list(item["output_ids"])[-len(tokens) :] != tokens and tokens:
        raise DeploymentRequestError("SGLang output_ids disagree with output_token_logprobs ids", url=url)
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else str(finish)
    if kind not in FINISH_REASONS:
        raise DeploymentRequestError(f"SGLang finish_reason {finish!r} is not one of {tuple(FINISH_REASONS)}", url=url)
    return Completion(
        full_tokens=list(prompt_ids) + tokens,
        prompt_len=len(prompt_ids),
        inference_logprobs=[float(x[0]) for x in lps],
        finish_reason=FINISH_REASONS[kind],
        text=item.get("text", ""),
        weight_version=_version(meta, sent_under),
        cached_tokens=int(meta.get("cached_tokens") or 0),
    )


class SGLangSampler(DeploymentSampler):
    """``DeploymentSampler`` over SGLang's native ``/generate`` (exact token ids and logprobs)."""

    def __init__(self, *args: Any, tokenizer: Any = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.tokenizer = tokenizer
        """Renders chat messages for ``chat`` (the model's tokenizer with its chat template)."""

    def with_defaults(self, **sampling: Any) -> "SGLangSampler":
        s = super().with_defaults(**sampling)
        s.tokenizer = self.tokenizer
        return s

    async def sample_with_prompt_tokens(
        self, prompt_ids: list[int], n: int = 1, *, session_id: Optional[str] = None, **sampling: Any
    ) -> list[Completion]:
        """Sample ``n`` completions of a token-id prompt via ``/generate``."""
        body = build_generate_request(prompt_ids, n, {**self.sampling_defaults, **sampling})
        sent_under = self._client.noted_weight_version
        out = await self.request("POST", "/generate", body, session_id)
        items = out if isinstance(out, list) else [out]
        if len(items) != n:
            raise DeploymentRequestError(f"SGLang returned {len(items)} answers for {n} samples", url=self.base_url)
        return [parse_generate_item(prompt_ids, it, sent_under=sent_under, url=self.base_url) for it in items]

    async def chat(
        self,
        messages: list[dict],
        n: int = 1,
        *,
        tools: Optional[list[dict]] = None,
        session_id: Optional[str] = None,
        **sampling: Any,
    ) -> list[Completion]:
        """Render ``messages`` with the chat template (needs ``tokenizer``) and sample from the ids; tool calls are
        read in the format the template writes (``select_tool_parser("auto", ...)``, as the embedded server's
        default)."""
        if self.tokenizer is None:
            raise ValueError(
                "tokenizer: SGLangSampler.chat renders the chat template locally; "
                "pass tokenizer= (the model's tokenizer)"
            )
        prompt = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        result = await self.sample_with_prompt_tokens(list(prompt), n, session_id=session_id, **sampling)
        parser = select_tool_parser("auto", self.tokenizer.chat_template)[0]
        for c in result:
            content, calls = parse_tool_calls(c.text, parser, tools) if tools else (c.text, [])
            c.message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
            c.text = content
            if calls and c.finish_reason == "stop":
                c.finish_reason = "tool_calls"
        return result

    async def weight_version(self) -> int:
        """The version served now (``GET /get_weight_version``; the noted one if SGLang has no int)."""
        versions = await asyncio.gather(
            *(self.request("GET", "/get_weight_version", base_url=u) for u in self.base_urls)
        )
        return min(_version(v, self._client.noted_weight_version) for v in versions)


def distributed_init_body(
    master_address: str,
    master_port: int,
    world_size: int,
    *,
    rank_offset: int = 1,
    group_name: str = "weight_update_group",
    backend: str = "nccl",
) -> dict:
    """``POST /init_weights_update_group`` body: the trainer is rank 0, the server's GPUs follow."""
    if world_size < 2:
        raise ValueError(f"world_size: the trainer plus at least one server rank, got {world_size}")
    return {
        "master_address": master_address,
        "master_port": int(master_port),
        "rank_offset": rank_offset,
        "world_size": world_size,
        "group_name": group_name,
        "backend": backend,
    }


def distributed_update_body(
    named_tensors: Iterable[tuple[str, Any]], weight_version: int, *, group_name: str = "weight_update_group"
) -> dict:
    """``POST /update_weights_from_distributed`` body; the trainer then broadcasts each tensor in order."""
    names, dtypes, shapes = [], [], []
    for name, t in named_tensors:
        names.append(name)
        dtypes.append(str(t.dtype).removeprefix("torch."))
        shapes.append(list(t.shape))
    if not names:
        raise ValueError("named_tensors: no tensors given")
    return {
        "names": names,
        "dtypes": dtypes,
        "shapes": shapes,
        "group_name": group_name,
        "flush_cache": True,
        "weight_version": str(int(weight_version)),
    }


class SGLangDeployment(ServerProcess):
    """SGLang's server, launched from ``cfg.engine_python`` or attached by URL (GPU only)."""

    engine = "sglang"

    def __init__(
        self, model: str, cfg: Optional[DeployConfig] = None, *, extra_args: Iterable[str] = (), **kwargs: Any
    ):
        super().__init__(model, cfg, extra_args=[*(cfg or DeployConfig()).engine_args, *extra_args], **kwargs)
        self.python = self.cfg.engine_python or sys.executable
        self.last_sync: dict[str, float] = {}

    def sleep(self, level: int = 1) -> dict:
        """Not wired (SGLang has no ``/sleep``; its ``/release_memory_occupation`` is not driven here): a colocated
        SGLang config is refused when it is built (``Backend.sleep_levels`` is empty), so nothing calls this."""
        raise NotImplementedError("SGLang replicas cannot sleep here (deployment.colocate is refused for sglang)")

    wake_up = is_sleeping = sleep

    def _command(self) -> list[str]:
        cmd = [
            self.python,
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.model,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--context-length",
            str(self.cfg.engine_config.max_model_len),
            "--max-running-requests",
            str(self.cfg.engine_config.max_batch_size),
        ]
        if self.cfg.engine_config.dtype != "auto":
            cmd += ["--dtype", self.cfg.engine_config.dtype]
        if self.cfg.engine_config.seed is not None:
            cmd += ["--random-seed", str(self.cfg.engine_config.seed)]
        if self.placement is not None and len(self.placement.gpus) > 1:
            cmd += ["--tp-size", str(len(self.placement.gpus))]
        if self.cfg.gpu_memory_fraction is not None:
            cmd += ["--mem-fraction-static", str(self.cfg.gpu_memory_fraction)]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        return cmd + self.extra_args

    def _copy_config(self, folder: Path) -> None:
        """``config.json`` (and ``generation_config.json``) of the served model next to the weights:
        from its folder, or for a hub id from where transformers' ``cached_file`` finds it (the local
        cache; downloaded if missing). A missing ``config.json`` raises ``WeightSyncError``."""
        for name in CONFIG_FILES:
            if (folder / name).exists():
                continue
            src = model_file(self.model, name)
            if src is not None:
                shutil.copy2(src, folder / name)
            elif name == "config.json":
                raise WeightSyncError(f"no config.json for {self.model!r} (a folder or a hub id); SGLang needs it")

    def load_weights(
        self,
        folder: str,
        weight_version: int,
        *,
        mode: str = "shm",
        wait_for_inflight: bool = True,
        force: bool = False,
    ) -> dict:
        """Copy the model's config next to the weights and ``POST /update_weights_from_disk``.

        Returns ``{"reload_s"}``; raises ``WeightSyncError`` when SGLang answers ``success: false``
        (it keeps its old weights then)."""
        self._copy_config(Path(folder))
        body = {"model_path": str(folder), "weight_version": str(int(weight_version)), "abort_all_requests": False}
        t0 = time.perf_counter()
        if not wait_for_inflight:
            self._post("/pause_generation", {"mode": "retract"})
        try:
            out = self._post("/update_weights_from_disk", body)
        finally:
            if not wait_for_inflight:
                self._post("/continue_generation", {})
        if not isinstance(out, dict) or not out.get("success", False):
            raise WeightSyncError(
                f"{self.base_url}/update_weights_from_disk refused v{weight_version} from {folder}: {str(out)[:2000]}"
            )
        self.last_sync = {"reload_s": time.perf_counter() - t0}
        return dict(self.last_sync)

    def _post(self, path: str, body: Optional[dict] = None) -> Any:
        status, text = self._http("POST", path, body, timeout=max(self.cfg.request_timeout_s, 600.0))
        if status != 200:
            raise WeightSyncError(f"{self.base_url}{path}: HTTP {status or 'no answer'}: {text[:2000]}")
        try:
            return json.loads(text) if text else None
        except ValueError:
            return text
