"""Weight sync in the server's dtype: an fp32 trainer pushes to a real bf16 embedded server (CPU, torch
step) over each transport (disk, shm, distributed/gloo); the bytes that travel are bf16 and the server
then answers exactly like a fresh bf16 server started on the same fp32 weights. Also: bucketed
broadcasts (several buckets give the same weights) and the shm free-space check falling back to disk.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from pathlib import Path

import aiohttp
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from training.deployment.weights import files as weight_sync
from training.deployment.weights.distributed import DistributedWeightSender
from training.deployment.group import DeploymentGroup
from training.deployment.weights.buckets import plan_buckets
from training.utils.config import DeployConfig

API_KEY = "dtype-key"
PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]


BF16_SERVER = dict(api_key=API_KEY, served_model_name="tiny", max_model_len=256, max_batch_size=4, dtype="bfloat16")


def perturbed(model_path: str, seed: int) -> dict[str, torch.Tensor]:
    """fp32 master weights of a "trained" model: the checkpoint plus noise."""
    g = torch.Generator().manual_seed(seed)
    return {
        k: (v.float() + torch.randn(v.shape, generator=g) * (0.5 if "norm" in k else v.float().std())).contiguous()
        for k, v in load_file(f"{model_path}/model.safetensors").items()
    }


@pytest.fixture(scope="module")
def weights(tiny_model_path):
    return {"original": load_file(f"{tiny_model_path}/model.safetensors"), "trained": perturbed(tiny_model_path, 1)}


@pytest.fixture(scope="module")
def servers(embedded_server, tiny_model_path, weights, tmp_path_factory):
    """(live, reference): the server the pushes go to, and a fresh bf16 server started on the trained
    fp32 weights (its own loader casts them); both fresh, started at once."""
    folder = tmp_path_factory.mktemp("dtype") / "trained-model"
    shutil.copytree(tiny_model_path, folder)
    save_file(weights["trained"], str(folder / "model.safetensors"))
    return embedded_server.together(BF16_SERVER, {**BF16_SERVER, "model": str(folder)})


def answer(url: str) -> tuple[list[int], list[float], int]:
    """Greedy token ids, their logprobs and the weight version."""

    async def go():
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as s:
            body = {
                "model": "tiny",
                "prompt": PROMPT,
                "max_tokens": 16,
                "temperature": 0.0,
                "ignore_eos": True,
                "logprobs": 0,
                "return_token_ids": True,
            }
            async with s.post(url + "/v1/completions", data=json.dumps(body)) as r:
                assert r.status == 200, await r.text()
                ch = (await r.json())["choices"][0]
                return ch["token_ids"], ch["logprobs"]["token_logprobs"], ch["weight_version"]

    return asyncio.run(go())


def reset(live, weights, version: int, reference) -> None:
    """Put the original weights back (the live server then answers unlike the reference)."""
    group = DeploymentGroup.attach([live.base_url], DeployConfig(api_key=API_KEY, weight_sync="shm"))
    try:
        asyncio.run(group.push(weights["original"].items(), version))
    finally:
        group.stop()
    assert answer(live.base_url)[:2] != answer(reference.base_url)[:2]


def file_dtypes(path: str) -> set[str]:
    with safe_open(path, framework="pt") as f:
        return {str(f.get_slice(k).get_dtype()) for k in f.keys()}


def test_bucket_plan_keeps_order_never_mixes_dtypes_and_respects_the_size():
    f32, bf16 = torch.float32, torch.bfloat16
    dtypes = [f32, f32, f32, bf16, bf16, f32]
    shapes = [(4,), (4,), (8,), (2,), (2,), (100,)]
    assert plan_buckets(dtypes, shapes, 32) == [range(0, 2), range(2, 3), range(3, 5), range(5, 6)]
    assert plan_buckets(dtypes, shapes, 0) == [range(i, i + 1) for i in range(6)]  # tensor by tensor
    assert plan_buckets(dtypes, shapes, 1 << 30) == [range(0, 3), range(3, 5), range(5, 6)]
    assert plan_buckets([], [], 32) == []


def test_server_reports_its_dtype(servers):
    assert servers[0].weight_dtype() == "bfloat16"


@pytest.mark.parametrize("mode", ["disk", "shm"])
def test_file_push_writes_bf16_and_matches_a_fresh_bf16_server(servers, weights, mode, tmp_path):
    live, reference = servers
    version = {"disk": 10, "shm": 20}[mode]
    reset(live, weights, version, reference)
    group = DeploymentGroup.attach(
        [live.base_url], DeployConfig(api_key=API_KEY, weight_sync=mode), weights_dir=tmp_path / "w"
    )
    try:
        out = asyncio.run(group.push(weights["trained"].items(), version + 1))
        assert out["mode"] == mode and out["dtype"] == "bfloat16"
        assert file_dtypes(out["path"]) == {"BF16"}  # the file holds what the server loads
        fp32_bytes = sum(t.numel() * 4 for t in weights["trained"].values())
        assert out["bytes"] < 0.6 * fp32_bytes
    finally:
        group.stop()
    ids, logprobs, got_version = answer(live.base_url)
    assert got_version == version + 1
    assert (ids, logprobs) == answer(reference.base_url)[:2]


@pytest.mark.parametrize("bucket_mb", [0, 0.05])
def test_distributed_push_broadcasts_bf16_and_matches_a_fresh_bf16_server(servers, weights, bucket_mb):
    """bucket 0: tensor by tensor, each received straight into the live bf16 weight (no buffer: only
    possible when bf16 bytes arrive); 0.05 MiB: several buckets, unflattened by the server."""
    live, reference = servers
    version = 30 if bucket_mb == 0 else 40
    reset(live, weights, version, reference)
    cfg = DeployConfig(
        api_key=API_KEY,
        base_url=live.base_url,
        weight_sync="distributed",
        weight_sync_master_addr="127.0.0.1",
        weight_bucket_mb=bucket_mb,
        request_timeout_s=60,
    )
    group = DeploymentGroup("", cfg)
    try:
        out = asyncio.run(group.push(weights["trained"].items(), version + 1))
    finally:
        group.stop()
    tensors = list(weights["trained"].values())
    bf16_bytes = sum(t.numel() * 2 for t in tensors)
    server = out["servers"][live.base_url]
    assert out["dtype"] == "bfloat16" and out["bytes"] == bf16_bytes
    assert server["received_bytes"] == bf16_bytes
    if bucket_mb == 0:
        assert out["num_buckets"] == len(tensors) and server["peak_buffer_bytes"] == 0
    else:
        bucket = int(bucket_mb * 2**20)
        assert 2 < out["num_buckets"] < len(tensors)
        assert 0 < server["peak_buffer_bytes"] <= max(bucket, max(t.numel() * 2 for t in tensors))
    ids, logprobs, got_version = answer(live.base_url)
    assert got_version == version + 1
    assert (ids, logprobs) == answer(reference.base_url)[:2]


def test_sender_buckets_fp32_to_fp32_identically(servers, weights):
    """No cast (dtype None): fp32 buckets into the bf16 server go through its buffer and land the same."""
    live, reference = servers
    reset(live, weights, 50, reference)

    async def go():
        async with DistributedWeightSender(
            [live.base_url], "127.0.0.1", 0, api_key=API_KEY, timeout_s=60, bucket_bytes=30_000
        ) as s:
            return await s.push(weights["trained"].items(), 51)

    out = asyncio.run(go())
    assert out["num_buckets"] > 2 and out["bytes"] == sum(t.numel() * 4 for t in weights["trained"].values())
    assert answer(live.base_url)[:2] == answer(reference.base_url)[:2]


def test_shm_that_does_not_fit_falls_back_to_disk(servers, weights, monkeypatch, caplog):
    """A stand-in for a full /dev/shm (which cannot be produced safely): the free-space probe says 1 KiB."""
    live, reference = servers
    reset(live, weights, 60, reference)
    monkeypatch.setattr(weight_sync, "shm_free_bytes", lambda folder: 1024)
    group = DeploymentGroup.attach([live.base_url], DeployConfig(api_key=API_KEY, weight_sync="shm"))
    try:
        with caplog.at_level(logging.WARNING, logger="training.deployment.group"):
            out = asyncio.run(group.push(weights["trained"].items(), 61))
        assert out["mode"] == "disk" and not out["path"].startswith("/dev/shm")
        assert file_dtypes(out["path"]) == {"BF16"}
        warnings = [r for r in caplog.records if "do not fit" in r.getMessage()]
        assert len(warnings) == 1
        disk_folder = Path(out["path"]).parent
    finally:
        group.stop()
    assert not disk_folder.exists()  # the fallback's temp folder goes with the group
    ids, logprobs, version = answer(live.base_url)
    assert version == 61 and (ids, logprobs) == answer(reference.base_url)[:2]


def test_shm_of_one_and_a_half_weights_takes_two_pushes(servers, weights, monkeypatch, caplog):
    """/dev/shm of 1.5x the weights file pushes twice, both times to shm: the second push writes in place of
    the first file, which the rename would otherwise need beside it. A fake tmpfs (a real one of a chosen size
    cannot be mounted by a test): the free-space probe reports 1.5x the file minus what the shm folder holds,
    and a write that leaves the folder holding more than that fails with ENOSPC, as a full tmpfs would."""
    import errno

    import safetensors.torch

    live, reference = servers
    reset(live, weights, 80, reference)
    need = weight_sync.weights_nbytes(
        [(n, t.dtype, tuple(t.shape)) for n, t in weights["trained"].items()], torch.bfloat16
    )
    capacity = int(need * 1.5) + 4096  # + the header's bytes
    owned: list[Path] = []

    def used() -> int:
        return sum(f.stat().st_size for d in owned for f in d.iterdir() if f.is_file())

    real_save = safetensors.torch.save_file

    def save_on_small_tmpfs(tensors, filename, *args, **kwargs):
        real_save(tensors, filename, *args, **kwargs)
        if Path(filename).parent in owned and used() > capacity:
            Path(filename).unlink()
            raise OSError(errno.ENOSPC, "No space left on device (fake tmpfs)", filename)

    monkeypatch.setattr(safetensors.torch, "save_file", save_on_small_tmpfs)
    monkeypatch.setattr(weight_sync, "shm_free_bytes", lambda folder: capacity - used())
    group = DeploymentGroup.attach([live.base_url], DeployConfig(api_key=API_KEY, weight_sync="shm"))
    try:
        group._file_folder([], None)  # creates the shm folder, so the fake can count what it holds
        owned.append(group._folder.folder)
        with caplog.at_level(logging.INFO, logger="training.deployment.group"):
            for version in (81, 82):
                out = asyncio.run(group.push(weights["trained"].items(), version))
                assert out["mode"] == "shm" and out["path"].startswith(str(owned[0]))
                assert answer(live.base_url) == (*answer(reference.base_url)[:2], version)
        assert sum("only in place" in r.getMessage() for r in caplog.records) == 1  # the second push
        assert not any("do not fit" in r.getMessage() for r in caplog.records)
    finally:
        group.stop()
