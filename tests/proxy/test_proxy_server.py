"""The proxy between the real ``openai`` client and the real deployment server (tiny model)."""

import asyncio

import openai
import pytest

from training.proxy import AGENT_HEADER, SESSION_HEADER, ProxyServer, make_proxy_rollout_fn, stitch_calls
from training.proxy.rollout import AgentFailedError
from training.utils.rl.rollout import RolloutRun, RolloutSetup, validate_sample

SYSTEM = {"role": "system", "content": "You add numbers."}


@pytest.fixture(scope="module")
def server(embedded_server):
    return embedded_server(max_batch_size=16)


def client_for(proxy, sid=None, **headers):
    """A session by URL prefix (``sid``) or by header (``headers``)."""
    base = proxy.session_url(sid) if sid else proxy.base_url
    return openai.AsyncOpenAI(base_url=base, api_key=proxy.api_key, default_headers=headers or None, max_retries=0)


def mask1(sample):
    return [t for t, m in zip(sample.tokens, sample.loss_mask) if m == 1]


def is_prefixes_then_last(seq, outs):
    """``seq`` = a prefix of outs[0] + a prefix of outs[1] + ... + the whole of outs[-1]."""
    reach = {0}
    for o in outs[:-1]:
        reach = {p + k for p in reach for k in range(len(o) + 1) if seq[p : p + k] == o[:k]}
    return any(seq[p:] == outs[-1] for p in reach)


def test_scripted_conversation_is_labelled_new_append_wipe(server):
    async def go():
        async with ProxyServer([server.base_url]) as proxy:
            c = client_for(proxy, "chat-1")
            msgs = [SYSTEM, {"role": "user", "content": "What is 2 + 3?"}]
            r1 = await c.chat.completions.create(model="gpt-x", messages=msgs, max_tokens=4, seed=1)
            msgs += [r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
            await c.chat.completions.create(model="gpt-x", messages=msgs, max_tokens=4, seed=2)
            compacted = [SYSTEM, {"role": "user", "content": "Summary: asked 2 + 3. Answer now."}]
            r3 = await c.chat.completions.create(model="gpt-x", messages=compacted, max_tokens=4, seed=3)
            edited = [
                SYSTEM,
                {"role": "user", "content": "What is 4 + 4?"},
                r3.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": "Go."},
            ]
            await c.chat.completions.create(model="gpt-x", messages=edited, max_tokens=4, seed=4)
            return r1, proxy.close_session("chat-1")

    r1, session = asyncio.run(go())
    kinds = [k for k, _ in session.labels()]
    reasons = [r for _, r in session.labels()]
    assert kinds == ["NEW", "APPEND", "WIPE", "WIPE"]
    assert reasons[1].startswith("prompt extends previous call")
    assert reasons[2] == "context compacted: 5 messages expected, 2 sent (first change at index 1)"
    assert reasons[3] == "message hash changed at index 1 (role 'user')"
    # the agent got a plain OpenAI response: its model name, no token fields, no logprobs
    assert r1.model == "gpt-x" and r1.choices[0].logprobs is None
    assert "token_ids" not in (r1.choices[0].model_extra or {}) and "prompt_token_ids" not in (r1.model_extra or {})
    assert all(len(c.output_logprobs) == len(c.output_ids) > 0 for c in session.calls)


def test_stitched_masks_are_the_server_output_ids(server):
    """Token-in agent (completions, header session): one APPEND chain, masks exact to the server's ids."""

    async def go():
        async with ProxyServer([server.base_url]) as proxy:
            c = client_for(proxy, **{SESSION_HEADER: "tok-1"})
            prompt, seen = [1, 30, 31, 32, 201], []
            for turn in range(3):
                r = await c.completions.create(
                    model="m", prompt=prompt, max_tokens=5, logprobs=0, seed=turn, extra_body={"return_token_ids": True}
                )
                ch = r.choices[0]
                assert ch.model_extra["prompt_token_ids"] == prompt
                seen.append((ch.model_extra["token_ids"], ch.logprobs.token_logprobs))
                prompt = prompt + ch.model_extra["token_ids"] + [201, 40 + turn]
            return proxy.close_session("tok-1"), seen

    session, seen = asyncio.run(go())
    assert [k for k, _ in session.labels()] == ["NEW", "APPEND", "APPEND"]
    res = stitch_calls(session.calls, reward=1.0)
    [seg] = res.samples
    validate_sample(seg)
    assert mask1(seg) == [t for ids, _ in seen for t in ids]
    assert [lp for lp, m in zip(seg.logprobs, seg.loss_mask) if m] == [x for _, lps in seen for x in lps]
    assert seg.tokens[:5] == [1, 30, 31, 32, 201] and seg.loss_mask[:5] == [0] * 5


def test_chat_episodes_never_train_shifted_tokens(server):
    """Re-rendered chat: whatever drift happens, every segment's mask-1 tokens are its calls' outputs."""

    async def go():
        async with ProxyServer([server.base_url]) as proxy:
            sessions, outputs = [], {}
            for k in range(6):
                c, sid = client_for(proxy, f"ep-{k}"), f"ep-{k}"
                msgs = [{"role": "user", "content": "What is 2 + 3?"}]
                for turn in range(3):
                    r = await c.chat.completions.create(
                        model="m",
                        messages=msgs,
                        max_tokens=4,
                        seed=10 * k + turn,
                        extra_body={"return_token_ids": True},
                    )
                    outputs[(sid, turn)] = r.choices[0].model_extra["token_ids"]
                    reply = r.choices[0].message.model_dump(exclude_none=True)
                    if k == 0 and turn == 0:  # a deliberate re-render mismatch: same message hash, other tokens
                        reply["content"] = "  " + (reply.get("content") or "")
                    msgs = msgs + [reply, {"role": "user", "content": "go on"}]
                sessions.append(proxy.close_session(sid))
            return sessions, outputs

    sessions, outputs = asyncio.run(go())
    drift_calls = 0
    for s in sessions:
        assert [k for k, _ in s.labels()] == ["NEW", "APPEND", "APPEND"]
        drift_calls += sum(c.label.token_drift for c in s.calls)
        for policy in ("split", "mask"):
            res = stitch_calls(s.calls, reward=0.5, on_drift=policy)
            for seg, idx in zip(res.samples, res.segment_calls):
                validate_sample(seg)
                server_out = [t for i in idx for t in outputs[(s.session_id, i)]]
                if policy == "split":
                    assert mask1(seg) == server_out
                else:  # each call's output or a prefix of it, in order (a drifted tail is masked out)
                    outs = [outputs[(s.session_id, i)] for i in idx]
                    assert is_prefixes_then_last(mask1(seg), outs)
    forced = sessions[0].calls[1].label
    assert forced.token_drift and "re-render drift" in forced.reason
    split = stitch_calls(sessions[0].calls, on_drift="split")
    assert len(split.samples) >= 2 and split.drift_events[0]["call"] == 1
    assert drift_calls >= 1


def test_transitions_credit_and_agent_selection(server, tiny_model_path):
    """Two roles in one episode: only the solver's calls are trained, rewards from a custom credit fn."""

    async def agent(row, ep):
        solver = openai.AsyncOpenAI(
            base_url=ep.base_url, api_key=ep.api_key, max_retries=0, default_headers={AGENT_HEADER: "solver"}
        )
        critic = openai.AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        msgs = [{"role": "user", "content": row["q"]}]
        for _ in range(3):
            r = await solver.chat.completions.create(model=ep.model, messages=msgs, max_tokens=3)
            msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
            await critic.chat.completions.create(
                model=ep.model, user="critic", max_tokens=2, messages=[{"role": "user", "content": "judge"}]
            )
        return "5"

    def credit(calls, ret):
        return [ret * (i + 1) for i in range(len(calls))]

    setup_hooks = []

    async def go():
        from training.deployment.client import DeploymentSampler

        sampler = DeploymentSampler(server.base_url)
        setup = RolloutSetup(sampler=sampler, tokenizer=None, sampling_kwargs={"temperature": 1.0, "max_tokens": 8})
        make = make_proxy_rollout_fn(
            agent,
            reward_fn=lambda row, ans: float(ans == row["a"]),
            mode="transitions",
            credit_fn=credit,
            agents=["solver"],
        )
        try:
            rollout_fn = make(setup)
            setup_hooks.extend(setup.weight_sync_hooks)
            return await rollout_fn({"q": "2 + 3?", "a": "5"})
        finally:
            await sampler.close()

    run = asyncio.run(go())
    assert isinstance(run, RolloutRun) and run.reward == 1.0
    calls = run.metadata["calls"]
    assert [c["agent"] for c in calls] == ["solver", "critic"] * 3
    solver_calls = [c["index"] for c in calls if c["agent"] == "solver"]
    assert run.metadata["sample_calls"] == solver_calls and len(run.segments) == 3
    assert run.metadata["credited_rewards"] == [1.0, 2.0, 3.0] == [s.reward for s in run.segments]
    assert run.metadata["sample_weights"] == pytest.approx([1 / 3] * 3)
    # the credited rewards and the episode weights reach the recipe: the run keeps segment rewards
    assert run.segment_rewards and [s.reward for s in run.samples()] == [1.0, 2.0, 3.0]
    assert [s.weight for s in run.segments] == pytest.approx([1 / 3] * 3)
    assert len(setup_hooks) == 1  # the proxy pauses around every weight sync
    for seg, c in zip(run.segments, [c for c in calls if c["agent"] == "solver"]):
        validate_sample(seg)
        assert len(seg.tokens) == c["prompt_tokens"] + c["output_tokens"] and sum(seg.loss_mask) == c["output_tokens"]
    # the critic starts afresh every time: each of its later calls wipes its chain
    assert [c["label"] for c in calls] == ["NEW", "NEW", "APPEND", "WIPE", "APPEND", "WIPE"]


def test_sync_agent_stitched_and_failures(server):
    def agent(row, ep):  # a plain synchronous OpenAI-SDK agent: runs in a worker thread
        c = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        msgs = [{"role": "user", "content": row["q"]}]
        for _ in range(2):
            r = c.chat.completions.create(model="anything", messages=msgs, max_tokens=3)
            msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        if row.get("boom"):
            raise RuntimeError("agent bug")
        return r.choices[0].message.content

    async def lazy(row, ep):
        return "no calls"

    async def go():
        from training.deployment.client import DeploymentSampler

        sampler = DeploymentSampler(server.base_url)
        setup = RolloutSetup(sampler=sampler, tokenizer=None, sampling_kwargs={"temperature": 1.0})
        fn = make_proxy_rollout_fn(agent, reward_fn=lambda row, ans, session: float(len(session.calls)))(setup)
        try:
            run = await fn({"q": "hi"})
            with pytest.raises(AgentFailedError, match="agent raised RuntimeError: agent bug"):
                await fn({"q": "hi", "boom": True})
            with pytest.raises(AgentFailedError, match="no model call"):
                await make_proxy_rollout_fn(lazy, reward_fn=lambda r, a: 0.0)(setup)({"q": "x"})
            return run, fn.proxy
        finally:
            await sampler.close()

    run, proxy = asyncio.run(go())
    assert run.reward == 2.0 and run.metadata["mode"] == "stitch"
    assert [c["label"] for c in run.metadata["calls"]] == ["NEW", "APPEND"]
    assert sum(len(x) for x in run.metadata["segment_calls"]) == 2
    assert proxy.sessions == {}  # finished sessions are forgotten


def test_session_affinity_across_two_upstreams(server):
    """One server listed under two URLs: every call of a session goes to the URL its hash picks."""
    urls = [server.base_url, server.base_url.replace("127.0.0.1", "localhost")]

    async def go():
        async with ProxyServer(urls) as proxy:
            out = {}
            for k in range(10):
                sid = f"aff-{k}"
                c = client_for(proxy, **{SESSION_HEADER: sid})
                for _ in range(2):
                    await c.completions.create(model="m", prompt=[1, 20 + k, 201], max_tokens=2)
                out[sid] = (proxy.pool.pick(sid), proxy.close_session(sid))
            return out

    out = asyncio.run(go())
    for picked, session in out.values():
        assert [c.upstream for c in session.calls] == [picked, picked]
    assert {picked for picked, _ in out.values()} == set(urls)


def test_pause_holds_new_calls_and_drain_waits_for_in_flight(server):
    async def go():
        async with ProxyServer([server.base_url]) as proxy:
            c = client_for(proxy, "p-1")
            proxy.gate.pause()
            held = asyncio.create_task(c.completions.create(model="m", prompt=[1, 5, 201], max_tokens=2))
            await asyncio.sleep(0.5)
            assert not held.done() and proxy.gate.in_flight == 0
            proxy.gate.resume()
            await held
            slow = asyncio.create_task(
                c.completions.create(model="m", prompt=[1, 6, 201], max_tokens=64, extra_body={"ignore_eos": True})
            )
            while proxy.gate.in_flight == 0 and not slow.done():  # a fast engine may answer before it is seen in flight
                await asyncio.sleep(0.001)
            await proxy.gate.pause_and_drain(timeout_s=60)
            assert slow.done() and proxy.gate.in_flight == 0
            proxy.gate.resume()
            return proxy.close_session("p-1")

    session = asyncio.run(go())
    assert len(session.calls) == 2 and len(session.calls[1].output_ids) == 64


def test_a_posted_reward_past_the_contract_bound_is_refused_naming_the_field(server):
    """Issue #29: the proxy accepted a per-call reward of 1e200, which then overflowed the advantages. It refuses
    what the rollout contract refuses (``MAX_ABS_REWARD``) and keeps what it allows."""
    import aiohttp

    from training.utils.rl.rollout import MAX_ABS_REWARD

    async def go():
        async with ProxyServer([server.base_url]) as proxy:
            c = client_for(proxy, "rw-1")
            await c.chat.completions.create(model="m", messages=[SYSTEM], max_tokens=2, seed=1)
            url = f"http://{proxy.host}:{proxy.port}/sessions/rw-1/reward"
            answers = []
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {proxy.api_key}"}) as http:
                for reward in (1e200, -MAX_ABS_REWARD * 2, MAX_ABS_REWARD, 0.5):
                    async with http.post(url, json={"reward": reward}) as r:
                        answers.append((r.status, await r.json()))
            return answers, proxy.close_session("rw-1")

    answers, session = asyncio.run(go())
    assert [status for status, _ in answers] == [400, 400, 200, 200]
    for _, body in answers[:2]:
        assert body["error"]["param"] == "reward" and "out of range" in body["error"]["message"]
    assert session.calls[0].posted_rewards == [MAX_ABS_REWARD, 0.5]
