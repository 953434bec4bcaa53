"""The configs of the commands that are not training runs: ``evaluate``, ``evaluate_clip`` and
``reward_server``.

They name their settings as the training config does (``--model.name``, ``--reward.name``,
``--data.eval_prompts``, ``--sampling.steps``, ``--run.seed``): the same sections and keys, but
only the keys the command uses, and defaults of its own where training's would be wrong (an
evaluation samples with the ODE, eta 0 and the model's own step count, which training's
`SamplingConfig` refuses). ``credit`` and ``profile`` measure what a training run would do and
take the whole `TrainConfig`. Each section checks itself as the training sections do; torch-free,
so a command checks its flags before it loads a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from chunk_grpo.config.checks import (
    check_image_size,
    check_reward_device,
    check_reward_spec,
    check_section,
)
from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.sampling_options import Sampler

# ----------------------------------------------------------------------------- sections


@dataclass
class GeneratorModelConfig:
    """The model that samples the images."""

    name: str = "embedded"  # diffusers directory or hub id; "embedded" = shipped tiny FLUX
    height: int | None = None  # null = the model's default size
    width: int | None = None

    def __post_init__(self) -> None:
        check_section(self, "model")
        check_image_size(self, "model")


@dataclass
class GeneratorNameConfig:
    """The model that samples the images."""

    name: str = "embedded"  # diffusers directory or hub id; "embedded" = shipped tiny FLUX


@dataclass
class ScoreRewardConfig:
    """What the images are scored with."""

    # a registered name, module:name, remote:URL, or a mix "a=1.0,b=0.5"
    name: str = "shapes"
    device: str = ""  # "" = the reward's own default device

    def __post_init__(self) -> None:
        check_reward_spec("reward.name", self.name)
        check_reward_device("reward.device", self.device, "the reward's own default")


@dataclass
class ServedRewardConfig:
    """The reward served."""

    # required: a registered name, module:name, or a mix "a=1.0,b=0.5"
    name: str = ""
    device: str = ""  # "" = the reward's own default device

    def __post_init__(self) -> None:
        if self.name:
            check_reward_spec("reward.name", self.name)
        check_reward_device("reward.device", self.device, "the reward's own default")


@dataclass
class EvalDataConfig:
    """The prompts."""

    # a .txt/.jsonl/.csv file, datasets DIR[::SPLIT], hf:NAME:SPLIT, or shapes:heldout ...
    eval_prompts: str = "shapes:heldout"


@dataclass
class EvalSamplingConfig:
    """How the images are sampled."""

    steps: int | None = None  # null = the model's default step count
    shift: float | None = None  # null = the model's default sigma shift
    sde: Sampler = "ode"  # the sampler: the ODE, or a stochastic kind (with sampling.eta)
    eta: float = 0.0  # noise level of a stochastic sampler
    cfg_scale: float | None = None  # null = the model's default_cfg_scale
    batch_size: int = 64  # images per transformer call

    def __post_init__(self) -> None:
        check_section(self, "sampling", at_least={"batch_size": 1}, positive=("shift",),
                      non_negative=("eta", "cfg_scale"))
        if self.steps is not None and self.steps < 2:
            raise ConfigError(f"sampling.steps must be >= 2 or null (the model's default), got "
                              f"{self.steps}")


@dataclass
class HybridEvalConfig:
    """Hybrid inference: the model for the first steps, a base model (--hybrid-base) after."""

    hybrid_steps: int = 0  # >0: the first K steps use model.name, the rest --hybrid-base

    def __post_init__(self) -> None:
        check_section(self, "eval", at_least={"hybrid_steps": 0})


@dataclass
class EvalRunConfig:
    """Where it runs, and its noise."""

    seed: int = 0  # the initial noise (a paired --compare needs the same seed)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda if available, else cpu
    progress: bool = True  # a progress bar while sampling

    def __post_init__(self) -> None:
        check_section(self, "run")


@dataclass
class SeedConfig:
    """The noise."""

    seed: int = 0  # sampling seed of the generated images


# ----------------------------------------------------------------------------- commands


@dataclass
class EvaluateConfig:
    """``chunk-grpo evaluate``: sample a prompt set and score it."""

    model: GeneratorModelConfig = field(default_factory=GeneratorModelConfig)
    reward: ScoreRewardConfig = field(default_factory=ScoreRewardConfig)
    data: EvalDataConfig = field(default_factory=EvalDataConfig)
    sampling: EvalSamplingConfig = field(default_factory=EvalSamplingConfig)
    eval: HybridEvalConfig = field(default_factory=HybridEvalConfig)
    run: EvalRunConfig = field(default_factory=EvalRunConfig)


@dataclass
class EvaluateClipConfig:
    """``chunk-grpo evaluate-clip``: the generated images a shapes-world CLIP is measured on."""

    model: GeneratorNameConfig = field(default_factory=GeneratorNameConfig)
    data: EvalDataConfig = field(default_factory=EvalDataConfig)
    run: SeedConfig = field(default_factory=SeedConfig)


@dataclass
class RewardServerConfig:
    """``chunk-grpo reward-server``: the reward served."""

    reward: ServedRewardConfig = field(default_factory=ServedRewardConfig)
