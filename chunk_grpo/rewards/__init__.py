"""Reward functions for RL fine-tuning, by name (`get_reward("shapes")`)."""

from chunk_grpo.rewards.hpsv3 import HPSv3Reward  # registers "hpsv3"
from chunk_grpo.rewards.registry import Reward, available_rewards, get_reward, register_reward
from chunk_grpo.rewards.shapes_reward import ShapesReward  # registers "shapes"

__all__ = ["HPSv3Reward", "Reward", "ShapesReward", "available_rewards", "get_reward",
           "register_reward"]
