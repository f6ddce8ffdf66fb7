"""Adapters of ``training/envs``: reasoning-gym and gym-style text environments on the tiny model and the
real server. Exact tokens (the server's ids), masks on the model's turns only, the library's own rewards."""

import asyncio

import pytest

from training.deployment.sampler import DeploymentSampler
from training.utils.rl.rollout import RolloutRun, RolloutSetup, flatten_result


class RecordingSampler(DeploymentSampler):
    """The real sampler; every call's prompt and completion are kept (``with_defaults`` keeps the class)."""

    calls: list = []

    async def sample_with_prompt_tokens(self, prompt_ids, n=1, **kw):
        out = await super().sample_with_prompt_tokens(prompt_ids, n, **kw)
        RecordingSampler.calls.append((list(prompt_ids), out[0]))
        return out


@pytest.fixture(scope="module")
def deployment(embedded_server):
    return embedded_server()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def run_rollouts(deployment, tokenizer, make_rollout_fn, rows, **sampling):
    RecordingSampler.calls.clear()

    async def go():
        sampler = RecordingSampler(deployment.base_url)
        setup = RolloutSetup(sampler=sampler, tokenizer=tokenizer, sampling_kwargs=sampling)
        try:
            fn = make_rollout_fn(setup)
            return [await fn(row) for row in rows]
        finally:
            await sampler.close()

    return asyncio.run(go())


def assert_exact(sample, calls):
    """Every call's prompt is a prefix of the sample; mask-1 tokens, logprobs and versions are the server's."""
    for prompt, _ in calls:
        assert sample.tokens[: len(prompt)] == prompt
    gen = [(t, lp) for t, lp, m in zip(sample.tokens, sample.logprobs, sample.loss_mask) if m == 1]
    assert [t for t, _ in gen] == [t for _, c in calls for t in c.output_tokens]
    assert [lp for _, lp in gen] == [lp for _, c in calls for lp in c.inference_logprobs]
    assert sample.token_weight_versions == [v for _, c in calls for v in c.token_weight_versions]
    first = calls[0][0]
    assert sample.loss_mask[: len(first)] == [0] * len(first)
    assert all(lp == 0.0 for lp, m in zip(sample.logprobs, sample.loss_mask) if m == 0)


# ---- reasoning-gym -------------------------------------------------------------------------------


@pytest.fixture
def rg():
    return pytest.importorskip("reasoning_gym")  # the [envs] extra; the gym tests below run without it


def test_last_number_answer_is_scored_by_the_library(rg):
    from training.envs import last_number_answer_fn, reasoning_gym_dataset, reasoning_gym_rows, reasoning_gym_scorer

    assert last_number_answer_fn("3 + 4 = 7, so Answer: 7.") == "7"
    assert last_number_answer_fn("It is -12") == "-12"
    assert last_number_answer_fn("1,024") == "1024"
    assert last_number_answer_fn("no digits here") is None
    ds = reasoning_gym_dataset("chain_sum", size=3, seed=5, min_terms=2, max_terms=3, max_digits=1)
    score = reasoning_gym_scorer(ds, last_number_answer_fn)
    for row in reasoning_gym_rows(ds):
        assert score(f"The sum is {row['answer']}.", row) == 1.0
        assert score(f"The sum is {int(row['answer']) + 1}.", row) < 1.0
        assert score("I cannot tell.", row) == 0.0


def test_reasoning_gym_rows_and_the_library_scorer(rg):
    from training.envs import reasoning_gym_dataset, reasoning_gym_rows, reasoning_gym_scorer

    ds = reasoning_gym_dataset("basic_arithmetic", size=4, seed=3, min_terms=2, max_terms=2, max_digits=1)
    rows = reasoning_gym_rows(ds)
    assert len(rows) == 4 and rows[0]["messages"][-1] == {"role": "user", "content": ds[0]["question"]}
    assert "<answer>" in rows[0]["messages"][0]["content"]  # reasoning-gym's default system prompt
    score = reasoning_gym_scorer(ds)
    right = f"thinking... <answer>{rows[0]['answer']}</answer>"
    assert score(right, rows[0]) == ds.score_answer(rows[0]["answer"], ds[0]) == 1.0
    assert score(rows[0]["answer"], rows[0]) == 0.0  # no <answer> tag: the library scores None

    mix = reasoning_gym_dataset({"chain_sum": 2.0, "basic_arithmetic": (1.0, {"max_terms": 2})}, size=12, seed=1)
    sources = {e["metadata"]["source_dataset"] for e in mix}
    assert sources == {"chain_sum", "basic_arithmetic"}
    mrows = reasoning_gym_rows(mix, system_prompt=None)
    assert all(len(r["messages"]) == 1 for r in mrows)
    assert all(reasoning_gym_scorer(mix)(f"<answer>{r['answer']}</answer>", r) == 1.0 for r in mrows)
    with pytest.raises(ValueError, match="weight"):
        reasoning_gym_dataset({"chain_sum": 0}, size=2)
    with pytest.raises(ValueError, match="settings"):
        reasoning_gym_dataset({"chain_sum": 1.0}, size=2, max_terms=3)


def test_reasoning_gym_rollouts_are_exact_and_scored_by_the_library(rg, deployment, tokenizer):
    from training.envs import make_reasoning_gym_rollout_fn, reasoning_gym_dataset, reasoning_gym_rows

    ds = reasoning_gym_dataset("chain_sum", size=3, seed=0, min_terms=2, max_terms=2)
    rows = reasoning_gym_rows(ds, system_prompt="Answer in <answer></answer> tags.")
    # answer_fn returns the reply itself, so the score is the library's on the exact generated text
    results = run_rollouts(
        deployment, tokenizer, make_reasoning_gym_rollout_fn(ds, answer_fn=lambda r: r), rows, max_tokens=8
    )
    calls = RecordingSampler.calls
    assert len(calls) == len(rows) == len(results)
    for row, result, call in zip(rows, results, calls):
        assert isinstance(result, RolloutRun)
        (sample,) = flatten_result(result)
        prompt, c = call
        want = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
        assert prompt == tokenizer.encode(want, add_special_tokens=False)  # the model's chat template
        assert_exact(sample, [call])
        assert sample.tokens == prompt + c.output_tokens
        text = tokenizer.decode(c.output_tokens, skip_special_tokens=True)
        assert result.reward == ds.score_answer(text.strip(), row["entry"])
        assert result.metadata["stop_reason"] == "finish" and result.metadata["messages"][-1]["content"] == text


# ---- gym-style text environments -----------------------------------------------------------------


class CountingEnv:
    """A text game: each reply earns (its length mod 3) / 2; three replies end it. ``gymnasium`` selects the
    5-tuple form of ``step`` and ``(obs, info)`` from ``reset``."""

    def __init__(self, gymnasium: bool, turns: int = 3):
        self.gymnasium, self.turns, self.actions = gymnasium, turns, []

    def reset(self):
        obs = "Say anything."
        return (obs, {"seed": 0}) if self.gymnasium else obs

    @staticmethod
    def reward(action: str) -> float:
        return (len(action) % 3) / 2

    def step(self, action):
        self.actions.append(action)
        obs, r, done = (
            f"You wrote {len(action)} characters. Again.",
            self.reward(action),
            len(self.actions) >= self.turns,
        )
        return (obs, r, done, False, {}) if self.gymnasium else (obs, r, done, {})


@pytest.mark.parametrize("gymnasium", [False, True])
def test_text_gym_episodes_are_token_in_token_out(deployment, tokenizer, gymnasium):
    from training.envs import make_text_gym_rollout_fn

    envs = []

    def factory(row):
        envs.append(CountingEnv(gymnasium))
        return envs[-1]

    make = make_text_gym_rollout_fn(factory, system_prompt="Play.", template_check="off")
    (result,) = run_rollouts(deployment, tokenizer, make, [{"id": 0}], max_tokens=6, temperature=1.0)
    calls, env = RecordingSampler.calls, envs[0]
    assert len(calls) == 3 and len(env.actions) == 3
    (sample,) = flatten_result(result)
    assert_exact(sample, calls)
    for k in range(1, 3):  # each prompt extends the previous prompt and the server's output
        assert calls[k][0][: len(calls[k - 1][0])] == calls[k - 1][0]
        out = calls[k - 1][1].output_tokens
        assert calls[k][0][len(calls[k - 1][0]) : len(calls[k - 1][0]) + len(out)] == out
    actions = [tokenizer.decode(c.output_tokens, skip_special_tokens=True).strip() for _, c in calls]
    assert env.actions == actions  # the environment saw the model's replies as generated
    assert result.reward == pytest.approx(sum(CountingEnv.reward(a) for a in actions))
    assert result.metadata["stop_reason"] == "finish"
    assert [m["role"] for m in result.metadata["messages"]] == ["system", "user", "assistant"] * 1 + [
        "user",
        "assistant",
    ] * 2


def test_text_gym_max_steps_and_bad_environments(deployment, tokenizer):
    from training.envs import make_text_gym_rollout_fn
    from training.envs.text_gym import unpack_step

    make = make_text_gym_rollout_fn(lambda row: CountingEnv(True, turns=10), max_steps=2, template_check="off")
    (result,) = run_rollouts(deployment, tokenizer, make, [{}], max_tokens=4)
    assert len(RecordingSampler.calls) == 2 and result.metadata["stop_reason"] == "max_steps"
    with pytest.raises(ValueError, match="expected"):
        unpack_step(("obs", 1.0))
    with pytest.raises(ValueError, match="not a number"):
        unpack_step(("obs", "high", True, {}))
    with pytest.raises(TypeError, match="reset"):
        run_rollouts(deployment, tokenizer, make_text_gym_rollout_fn(lambda row: object()), [{}], max_tokens=4)


# ---- verifiers -----------------------------------------------------------------------------------


def exact(completion, answer, **kwargs) -> float:
    return 1.0 if answer in (completion[-1].content or "") else 0.0


def brevity(completion, **kwargs) -> float:
    return 1.0 / (1 + len(completion[-1].content or ""))


def test_verifiers_environments_are_exact_and_scored_by_their_rubric(deployment, tokenizer):
    vf = pytest.importorskip("verifiers")  # not in setup.sh: heavy (training/envs/README.md)
    from datasets import Dataset

    from training.envs.verifiers_env import make_verifiers_rollout_fn, verifiers_rows

    class Retry(vf.MultiTurnEnv):
        """Local multi-turn environment: asks again after each reply, three turns."""

        async def env_response(self, messages, state, **kwargs):
            return [{"role": "user", "content": "Are you sure? Answer again."}]

    data = Dataset.from_list([{"question": "What is 2 + 2?", "answer": "4"}, {"question": "1 + 2?", "answer": "3"}])
    single = vf.SingleTurnEnv(
        dataset=data, system_prompt="Be brief.", rubric=vf.Rubric(funcs=[exact, brevity], weights=[1.0, 0.5])
    )
    multi = Retry(dataset=data, max_turns=3, rubric=vf.Rubric(funcs=[exact, brevity], weights=[1.0, 0.5]))
    for env, turns in ((single, 1), (multi, 3)):
        rows = verifiers_rows(env)
        results = run_rollouts(deployment, tokenizer, make_verifiers_rollout_fn(env), rows, max_tokens=6)
        calls = RecordingSampler.calls
        assert len(calls) == turns * len(rows)
        for i, result in enumerate(results):
            episode = calls[i * turns : (i + 1) * turns]
            (sample,) = flatten_result(result)
            assert_exact(sample, episode)
            want = tokenizer.apply_chat_template(rows[i]["prompt"], add_generation_prompt=True, tokenize=False)
            assert episode[0][0] == tokenizer.encode(want, add_special_tokens=False)
            last = tokenizer.decode(episode[-1][1].output_tokens, skip_special_tokens=True).strip()
            components = {"exact": float(rows[i]["answer"] in last), "brevity": 1.0 / (1 + len(last))}
            assert {k: result.metadata["reward_components"][k] for k in components} == pytest.approx(components)
            assert result.reward == pytest.approx(components["exact"] + 0.5 * components["brevity"])
            users = [m["content"] for m in result.metadata["messages"] if m["role"] == "user"]
            assert users[1:] == ["Are you sure? Answer again."] * (turns - 1)


def test_reward_components_reach_the_step_metrics():
    from training.utils.rl.run_metrics import run_metrics

    metas = [{"reward_components": {"exact": 1.0, "brevity": 0.2}}, {"reward_components": {"exact": 0.0}}, {}]
    out = run_metrics(metas)
    assert out["reward/exact"] == 0.5 and out["reward/brevity"] == pytest.approx(0.2)
    assert out["agent/episodes"] == 2.0
