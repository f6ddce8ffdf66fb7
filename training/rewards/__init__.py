"""Rewards without a verifier: a judge that ranks a prompt group (``judge.py``) and weighted rubrics (``rubric.py``).

Both are group rewards for ``Config.group_reward_fn`` (``training/utils/rl/group_reward.py``); see README.md."""

from training.rewards.judge import GroupJudge, Member
from training.rewards.judge_client import JudgeClient, JudgeConfig, JudgeError
from training.rewards.rubric import Criterion, Rubric

__all__ = ["Criterion", "GroupJudge", "JudgeClient", "JudgeConfig", "JudgeError", "Member", "Rubric"]
