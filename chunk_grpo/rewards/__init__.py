"""Reward functions for RL fine-tuning, by name (`get_reward("shapes")`), and weighted mixes of
them (`build_reward("a=1.0,b=0.5")`); scoring a run's rollouts (`scoring`) and serving a reward
over HTTP (`server`).
"""

from chunk_grpo.rewards.aesthetic import AestheticScore  # registers "aesthetic"
from chunk_grpo.rewards.clip_score import ClipScore  # registers "clip"
from chunk_grpo.rewards.hpsv2 import HPSv2Score  # registers "hpsv2"
from chunk_grpo.rewards.hpsv3 import HPSv3Reward  # registers "hpsv3"
from chunk_grpo.rewards.imagereward import ImageRewardScore  # registers "imagereward"
from chunk_grpo.rewards.jpeg import JpegCompressibility, JpegIncompressibility  # registers both
from chunk_grpo.rewards.judge import VLMJudge  # registers "judge" (judge:URL, judge:FILE)
from chunk_grpo.rewards.mix import RewardMix, build_reward
from chunk_grpo.rewards.outputs import RewardError, RewardOutputError, RewardUnavailableError
from chunk_grpo.rewards.pickscore import PickScore  # registers "pickscore"
from chunk_grpo.rewards.registry import (
    Reward,
    RewardLoadError,
    available_rewards,
    get_reward,
    register_reward,
    unregister_reward,
)
from chunk_grpo.rewards.remote import RemoteReward  # registers "remote" (remote:URL)
from chunk_grpo.rewards.shapes_clip import SHAPES_CLIP_DIR, shapes_clip  # registers "shapes-clip"
from chunk_grpo.rewards.shapes_reward import ShapesReward  # registers "shapes"

__all__ = ["SHAPES_CLIP_DIR", "AestheticScore", "ClipScore", "HPSv2Score", "HPSv3Reward",
           "ImageRewardScore",
           "JpegCompressibility", "JpegIncompressibility", "PickScore", "RemoteReward", "Reward",
           "RewardError", "RewardLoadError", "RewardMix", "RewardOutputError",
           "RewardUnavailableError", "ShapesReward", "VLMJudge", "available_rewards",
           "build_reward", "get_reward", "register_reward", "shapes_clip",
           "unregister_reward"]
