"""Weight sync over a torch.distributed group (gloo, loopback): trainer = this process, rank 0;
two real embedded servers on the tiny model = ranks 1 and 2.

The tests "with the group" share one sender and its two servers and run in file order (each push builds on
the versions before it). The "no group yet" checks ask a server that never joins a group, and the tests
that leave a server in a broken group (a trainer lost half-way, a stream that breaks its spec) have a server
of their own.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import aiohttp
import pytest
import torch
import torch.distributed as dist

from training.deployment.weights.distributed import DistributedWeightSender, accept_key, go_key, unique_weights
from training.deployment.group import push_weights
from training.deployment.weights.files import WeightSyncError

API_KEY = "dist-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]
SERVER = dict(api_key=API_KEY, served_model_name="tiny", max_model_len=512, max_batch_size=8)


@pytest.fixture(scope="module")
def servers(embedded_server):
    return embedded_server.together(SERVER, SERVER)  # fresh: the group's pushes change their weights


@pytest.fixture(scope="module")
def loop():
    """One event loop for the module: the sender's group lives across tests."""
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def sender(servers, loop):
    s = DistributedWeightSender(
        [d.base_url for d in servers], "127.0.0.1", 0, backend="gloo", api_key=API_KEY, timeout_s=60
    )
    loop.run_until_complete(s.connect())
    yield s
    s.close()


def call(base_url, method, path, body=None):
    async def go():
        async with aiohttp.ClientSession(headers=AUTH) as s:
            async with s.request(method, base_url + path, data=json.dumps(body) if body is not None else None) as r:
                return r.status, await r.json(content_type=None)

    return asyncio.run(go())


def complete(base_url, **body):
    status, out = call(base_url, "POST", "/v1/completions", {"model": "tiny", "prompt": PROMPT, **body})
    assert status == 200, out
    return out["choices"][0]


def greedy(base_url, n_tokens=12):
    ch = complete(base_url, max_tokens=n_tokens, temperature=0.0, ignore_eos=True, return_token_ids=True)
    return ch["token_ids"], ch["weight_version"]


def perturbed(model_path: str, seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors plus noise (norm weights get absolute noise: their std is 0)."""
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(seed)
    return {
        k: v + torch.randn(v.shape, generator=g) * (scale if "norm" in k else scale * v.std())
        for k, v in load_file(f"{model_path}/model.safetensors").items()
    }


def hf_model(model_path: str, tensors: dict[str, torch.Tensor]):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    model.load_state_dict(tensors, strict=False)  # tied head: the embedding carries it
    return model


def max_logprob_error(model, base_url, seed=3) -> float:
    ch = complete(
        base_url, max_tokens=24, temperature=1.0, seed=seed, ignore_eos=True, logprobs=0, return_token_ids=True
    )
    ids = torch.tensor([PROMPT + ch["token_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    ref = logp[len(PROMPT) - 1 : -1].gather(1, torch.tensor(ch["token_ids"])[:, None])[:, 0]
    return (ref - torch.tensor(ch["logprobs"]["token_logprobs"])).abs().max().item()


def meta_body(tensors: dict[str, torch.Tensor], version: int, **override) -> dict:
    body = {
        "names": list(tensors),
        "dtypes": ["float32"] * len(tensors),
        "shapes": [list(t.shape) for t in tensors.values()],
        "weight_version": version,
        "update_id": "test-update",
    }
    body.update(override)
    return body


# ---------------------------------------------------------------- no server needed


def test_unique_weights_sends_tied_tensors_once_and_rejects_bad_input():
    emb = torch.zeros(4, 2)
    items = unique_weights(
        [("model.embed_tokens.weight", emb), ("lm_head.weight", emb), ("model.norm.weight", torch.ones(2))]
    )
    assert [n for n, _ in items] == ["model.embed_tokens.weight", "model.norm.weight"]
    with pytest.raises(ValueError, match="dtype torch.int64"):
        unique_weights([("a", torch.zeros(2, dtype=torch.int64))])
    with pytest.raises(ValueError, match="duplicate tensor name 'a'"):
        unique_weights([("a", torch.zeros(2)), ("a", torch.ones(2))])
    with pytest.raises(ValueError, match="no tensors"):
        unique_weights([])


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"base_urls": []}, "base_urls"),
        ({"backend": "mpi"}, "backend"),
        ({"master_port": 70000}, "master_port"),
        ({"master_addr": ""}, "master_addr"),
    ],
)
def test_sender_arguments_are_checked(kwargs, field):
    args = {"base_urls": ["http://127.0.0.1:1"], "master_addr": "127.0.0.1", "master_port": 0, **kwargs}
    with pytest.raises(ValueError, match=field):
        DistributedWeightSender(**args)


# ---------------------------------------------------------------- before any group exists


def test_update_without_group_and_bad_init_bodies_are_400(embedded_server, tiny_model_path):
    url = embedded_server(**SERVER).base_url  # shared: a server no test lets join a group
    status, out = call(url, "POST", "/update_weights_from_distributed", meta_body(perturbed(tiny_model_path, 0), 1))
    assert status == 400 and "init_weight_update_group" in out["error"]["message"]
    good = {"master_addr": "127.0.0.1", "master_port": 29999, "rank": 1, "world_size": 2, "backend": "gloo"}
    for field, value in [
        ("backend", "nccl"),
        ("rank", 0),
        ("rank", 2),
        ("world_size", 1),
        ("backend", "mpi"),
        ("master_port", 0),
        ("master_addr", ""),
        ("timeout_s", -1),
    ]:
        status, out = call(url, "POST", "/init_weight_update_group", {**good, field: value})
        assert status == 400 and out["error"]["param"] == field, (field, out)


# ---------------------------------------------------------------- with the group


def test_push_reaches_both_servers_and_matches_transformers(servers, sender, loop, tiny_model_path):
    before = [greedy(d.base_url) for d in servers]
    assert [v for _, v in before] == [0, 0]
    new = perturbed(tiny_model_path, seed=1)
    model = hf_model(tiny_model_path, new)
    # a trainer's state_dict(): the tied lm_head shares the embedding's storage and travels once
    out = loop.run_until_complete(sender.push(model.state_dict().items(), 1))
    assert out["num_tensors"] == len(new) and out["bytes"] == sum(t.numel() * 4 for t in new.values())
    for d in servers:
        assert out["servers"][d.base_url]["weight_version"] == 1
        assert out["servers"][d.base_url]["peak_buffer_bytes"] == 0  # fp32 into fp32 CPU: received in place
        assert call(d.base_url, "GET", "/weight_version")[1] == {"weight_version": 1, "dtype": "float32"}
        ids, v = greedy(d.base_url)
        assert v == 1 and ids != before[0][0]
        err = max_logprob_error(model, d.base_url)
        print(f"{d.base_url}: max |server - transformers(new weights)| logprob = {err:.2e}")
        assert err < 1e-5
    assert not dist.is_initialized()  # the default group was never touched


def test_specs_let_a_lazy_iterator_stream_one_tensor_at_a_time(servers, sender, loop, tiny_model_path):
    """With ``specs`` the sender takes each tensor from the iterator only when it broadcasts it:
    a generator that makes a fresh full tensor per step (as FSDP2's gather does) never has two alive."""
    import gc
    import weakref

    new = perturbed(tiny_model_path, seed=4)
    live, most_alive = [], 0

    def gathered():
        nonlocal most_alive
        for name, t in new.items():
            gc.collect()
            most_alive = max(most_alive, sum(r() is not None for r in live))
            whole = t.clone()  # a fresh tensor per step, like a gathered DTensor
            live.append(weakref.ref(whole))
            yield name, whole
            del whole

    specs = [(n, t.dtype, tuple(t.shape)) for n, t in new.items()]
    out = loop.run_until_complete(sender.push(gathered(), 7, specs=specs))
    assert out["num_tensors"] == len(new) and len(live) == len(new)
    assert most_alive == 0  # every earlier tensor was released before the next one was made
    model = hf_model(tiny_model_path, new)
    for d in servers:
        assert out["servers"][d.base_url]["weight_version"] == 7
        assert max_logprob_error(model, d.base_url) < 1e-5


def test_bfloat16_weights_go_through_a_one_tensor_buffer(servers, sender, loop, tiny_model_path):
    new = {k: v.to(torch.bfloat16) for k, v in perturbed(tiny_model_path, seed=2).items()}
    out = loop.run_until_complete(sender.push(new.items(), 2))
    largest = max(t.numel() * 2 for t in new.values())
    model = hf_model(tiny_model_path, {k: v.float() for k, v in new.items()})
    for d in servers:
        answer = out["servers"][d.base_url]
        assert answer["weight_version"] == 2 and answer["peak_buffer_bytes"] == largest
        assert max_logprob_error(model, d.base_url) < 1e-5


@pytest.mark.parametrize(
    "override,param",
    [
        ({"dtypes": "float32"}, "dtypes"),
        ("bad_dtype", "dtypes"),
        ("unknown_name", "names"),
        ("missing_name", "names"),
        ("duplicate_name", "names"),
        ("bad_shape", "shapes"),
        ({"weight_version": "3"}, "weight_version"),
        ({"update_id": "../x"}, "update_id"),
        ({"wait_for_inflight": "yes"}, "wait_for_inflight"),
    ],
)
def test_bad_metadata_is_400_naming_the_field(servers, sender, tiny_model_path, override, param):
    tensors = perturbed(tiny_model_path, 0)
    body = meta_body(tensors, 3)
    names = body["names"]
    if override == "bad_dtype":
        body["dtypes"][1] = "torch.float32"
    elif override == "unknown_name":
        body["names"][0] = "model.layers.9.mlp.up_proj.weight"
    elif override == "missing_name":
        for k in ("names", "dtypes", "shapes"):
            body[k] = body[k][1:]
    elif override == "duplicate_name":
        body["names"][1] = names[0]
    elif override == "bad_shape":
        body["shapes"][2] = body["shapes"][2][:-1] + [body["shapes"][2][-1] + 1]
    else:
        body.update(override)
    before = greedy(servers[0].base_url)
    status, out = call(servers[0].base_url, "POST", "/update_weights_from_distributed", body)
    assert status == 400 and out["error"]["param"] == param, out
    assert greedy(servers[0].base_url) == before  # nothing moved: old weights and version


def test_refused_push_names_the_tensor_and_keeps_old_weights(servers, sender, loop, tiny_model_path):
    before = [greedy(d.base_url) for d in servers]
    bad = perturbed(tiny_model_path, seed=4)
    name = next(k for k in bad if k.endswith("q_proj.weight"))
    bad[name] = bad[name][:, :-1].contiguous()
    with pytest.raises(WeightSyncError) as e:
        loop.run_until_complete(sender.push(bad.items(), 9))
    assert "400" in str(e.value) and name in str(e.value)
    assert all(d.base_url in str(e.value) for d in servers)  # both refused, both named
    assert [greedy(d.base_url) for d in servers] == before
    # the group survives a refusal: the next good push lands everywhere
    out = loop.run_until_complete(sender.push(perturbed(tiny_model_path, seed=5).items(), 10))
    assert all(a["weight_version"] == 10 for a in out["servers"].values())


def test_an_accepted_update_is_dropped_when_the_trainer_aborts(servers, sender, tiny_model_path):
    """What a server that accepted does when another server refused: it keeps its old weights."""
    url = servers[0].base_url
    before = greedy(url)

    async def go():
        async with aiohttp.ClientSession(headers=AUTH) as s:
            req = asyncio.ensure_future(
                s.post(
                    url + "/update_weights_from_distributed",
                    json=meta_body(perturbed(tiny_model_path, 6), 11, update_id="abort-me"),
                )
            )
            while not sender.store.check([accept_key("abort-me", 1)]):
                await asyncio.sleep(0.01)
            sender.store.set(go_key("abort-me"), b"abort")
            resp = await req
            return resp.status, await resp.json()

    status, out = asyncio.run(go())
    assert status == 409 and "aborted" in out["error"]["message"]
    assert greedy(url) == before


def test_wait_for_inflight_finishes_running_sequences_on_old_weights(servers, sender, loop, tiny_model_path):
    url = servers[1].base_url
    old_ids, old_v = greedy(url, n_tokens=300)

    async def go():
        async with aiohttp.ClientSession(headers=AUTH) as s:
            long_req = asyncio.ensure_future(
                s.post(
                    url + "/v1/completions",
                    json={
                        "model": "tiny",
                        "prompt": PROMPT,
                        "max_tokens": 300,
                        "temperature": 0.0,
                        "ignore_eos": True,
                        "return_token_ids": True,
                    },
                )
            )
            while True:  # the long request is running when the update arrives
                async with s.get(url + "/stats") as r:
                    if (await r.json())["running"] == 1:
                        break
                await asyncio.sleep(0.005)
            await sender.push(perturbed(tiny_model_path, seed=7).items(), old_v + 1)
            resp = await long_req
            return (await resp.json())["choices"][0]

    ch = loop.run_until_complete(go())
    assert ch["weight_version"] == old_v and ch["token_ids"] == old_ids  # all 300 tokens from the old weights
    assert greedy(url)[1] == old_v + 1


def test_sync_time_distributed_vs_shm(servers, sender, loop, tiny_model_path):
    """Prints timings only (no timing asserts): one server, the same weights, three pushes each."""
    url = servers[0].base_url
    tensors = perturbed(tiny_model_path, seed=8)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    base = greedy(url)[1] + 1
    dist_s, shm_s = [], []
    for i in range(3):
        t0 = time.perf_counter()
        loop.run_until_complete(sender.push(tensors.items(), base + 2 * i))  # both servers
        dist_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        asyncio.run(push_weights(url, tensors.items(), base + 2 * i + 1, api_key=API_KEY))
        shm_s.append(time.perf_counter() - t0)
    assert greedy(url)[1] == base + 5
    print(
        f"tiny model {nbytes / 1e6:.2f} MB, {len(tensors)} tensors: distributed (gloo, 2 servers) "
        f"median {statistics.median(dist_s) * 1e3:.1f} ms; shm (1 server) median "
        f"{statistics.median(shm_s) * 1e3:.1f} ms"
    )


def test_trainer_lost_half_way_leaves_version_minus_one_until_a_full_update(embedded_server, tiny_model_path):
    """A server of its own joins a group whose trainer vanishes after half the tensors."""
    from training.deployment.weights.distributed import broadcast_from_trainer

    url = embedded_server(fresh=True, **SERVER).base_url
    tensors = perturbed(tiny_model_path, seed=9)
    half = list(tensors.values())[: len(tensors) // 2]

    async def go():
        lost = DistributedWeightSender([url], "127.0.0.1", 0, api_key=API_KEY, timeout_s=5)
        await lost.connect()
        async with aiohttp.ClientSession(headers=AUTH) as s:
            req = asyncio.ensure_future(
                s.post(url + "/update_weights_from_distributed", json=meta_body(tensors, 50, update_id="half-way"))
            )
            while not lost.store.check([accept_key("half-way", 1)]):
                await asyncio.sleep(0.01)
            lost.store.set(go_key("half-way"), b"go")
            for t in half:
                await asyncio.to_thread(broadcast_from_trainer, lost.pg, t)
            lost.close()  # the trainer is gone
            resp = await asyncio.wait_for(req, 60)
            return resp.status, await resp.json()

    status, out = asyncio.run(go())
    assert status == 500 and "half-way" in out["error"]["message"], out
    assert call(url, "GET", "/health")[1]["weight_version"] == -1
    assert greedy(url)[1] == -1  # still serving, but says the weights are no known version
    asyncio.run(push_weights(url, tensors.items(), 51, api_key=API_KEY))  # a full update repairs it
    assert greedy(url)[1] == 51


def test_a_tensor_that_does_not_match_its_spec_stops_the_push(embedded_server, tiny_model_path):
    """A server of its own, in a group of its own: the stream yields the wrong tensor third."""
    url = embedded_server(fresh=True, **SERVER).base_url
    tensors = perturbed(tiny_model_path, seed=11)
    names = list(tensors)
    specs = [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    swapped = (
        [(n, tensors[n]) for n in names[:2]] + [(names[3], tensors[names[3]])] + [(n, tensors[n]) for n in names[3:]]
    )

    async def go():
        async with DistributedWeightSender([url], "127.0.0.1", 0, api_key=API_KEY, timeout_s=30) as s:
            await s.push(iter(swapped), 60, specs=specs)

    with pytest.raises(WeightSyncError, match=f"expected '{names[2]}'"):
        asyncio.run(go())
    assert call(url, "GET", "/health")[1]["weight_version"] == -1  # a partial update is not a version
    asyncio.run(push_weights(url, tensors.items(), 61, api_key=API_KEY))  # a full update repairs it
    assert greedy(url)[1] == 61
