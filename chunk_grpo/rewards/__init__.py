"""Reward functions for RL fine-tuning, by name (`get_reward("shapes")`), and weighted mixes of
them (`build_reward("a=1.0,b=0.5")`)."""

from chunk_grpo.rewards.mix import RewardMix, build_reward
from chunk_grpo.rewards.outputs import RewardError, RewardOutputError, RewardUnavailableError
from chunk_grpo.rewards.registry import Reward, available_rewards, get_reward, register_reward
from chunk_grpo.rewards.remote import RemoteReward  # registers "remote" (remote:URL)
from chunk_grpo.rewards.shapes_reward import ShapesReward  # registers "shapes"

__all__ = ["RemoteReward", "Reward", "RewardError", "RewardMix", "RewardOutputError",
           "RewardUnavailableError", "ShapesReward", "available_rewards", "build_reward",
           "get_reward", "register_reward"]
