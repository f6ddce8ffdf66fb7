"""The documented import path for the deployment sampler used by example rollouts::

from training.examples.rl.vanilla_sampler import build_deployment_sampler

def make_rollout_fn(setup):
    sampler = build_deployment_sampler(setup)   # setup.sampler + the recipe's sampling defaults
    async def rollout_fn(row):
        [c] = await sampler.sample_with_prompt_tokens(prompt_ids, n=1)
        ...   # c.full_tokens, c.prompt_len, c.inference_logprobs, c.finish_reason
"""

from training.deployment.client import Completion, DeploymentRequestError, DeploymentSampler, build_deployment_sampler

__all__ = ["build_deployment_sampler", "DeploymentSampler", "Completion", "DeploymentRequestError"]
