"""Rewards by name: `register_reward("name")` on a factory, `get_reward("name", **kwargs)`.

Your own reward needs no change to this package: register it in a module of yours and name it
as "module:name" (e.g. `--reward.name my_rewards:redness`); `get_reward` imports the module first,
which runs its `@register_reward` decorators. "remote:URL" is the client of a reward server
(`chunk_grpo.rewards.remote`) and "judge:URL" / "judge:OPTIONS.yaml" a VLM judge behind an
OpenAI-compatible API (`chunk_grpo.rewards.judge`), never modules. A weighted mix of rewards is
built by `chunk_grpo.rewards.mix.build_reward`.
"""

from __future__ import annotations

import difflib
import importlib
import traceback
from collections.abc import Callable
from typing import Protocol

import torch

from chunk_grpo.rewards.judge_options import JUDGE_PREFIX, judge_options


class Reward(Protocol):
    """Scores images against their prompts: images [B, 3, H, W] in [0, 1] -> float32 [B] (CPU).

    A list, tuple or numpy array of B numbers is accepted too (see `chunk_grpo.rewards.outputs`).
    """

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor: ...


class UnknownRewardError(ValueError):
    """No reward is registered under the name asked for (or its module cannot be imported)."""


class RewardLoadError(ValueError):
    """A reward's model, weights, tokenizer or optional dependency cannot be loaded; the one-line
    message names the model or file and where to put it."""


_FACTORIES: dict[str, Callable[..., Reward]] = {}
REMOTE_PREFIX = "remote:"


def register_reward(name: str) -> Callable[[Callable[..., Reward]], Callable[..., Reward]]:
    """Decorator registering a reward factory (a class or function taking keyword options)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"reward name must be a non-empty str, got {name!r}")

    def decorate(factory: Callable[..., Reward]) -> Callable[..., Reward]:
        if name in _FACTORIES and _FACTORIES[name] is not factory:
            raise ValueError(f"a reward named {name!r} is already registered; pick another name")
        _FACTORIES[name] = factory
        return factory

    return decorate


def unregister_reward(name: str) -> None:
    """Remove the reward registered as `name` (e.g. a reward registered only for a test or a
    notebook cell), so the name can be registered again with another factory."""
    if name not in _FACTORIES:
        raise UnknownRewardError(f"cannot unregister reward {name!r}: it is not registered; "
                                 f"available: {available_rewards()}")
    del _FACTORIES[name]


def available_rewards() -> list[str]:
    return sorted(_FACTORIES)


def _import_reward_module(spec: str) -> str:
    """Import the module of a "module:name" spec and return the name."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise UnknownRewardError(f"reward {spec!r}: write 'module:name', e.g. "
                                 f"'my_rewards:redness'")
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is None or not module.startswith(err.name):  # one of its own imports
            raise RewardLoadError(_import_failed(spec, module, err)) from err
        raise UnknownRewardError(f"reward {spec!r}: cannot import module {module!r}; run from "
                                 f"the directory that holds it or add it to PYTHONPATH") from None
    except Exception as err:  # the module's own code failed: name where, in one line
        raise RewardLoadError(_import_failed(spec, module, err)) from err
    return name


def _import_failed(spec: str, module: str, err: Exception) -> str:
    """One line: which module failed to import, where in it, and why."""
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if not f.filename.startswith("<frozen")]
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    detail = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return (f"reward {spec!r}: importing module {module!r} failed{where}: "
            f"{type(err).__name__}{': ' + detail if detail else ''}; fix the module (or install "
            "what it imports)")


def reward_factory(spec: str) -> tuple[Callable[..., Reward], dict]:
    """(factory, keyword options it must get) of a reward spec: a registered name,
    "module:name" (the module is imported first), "remote:URL" (the reward server client) or
    "judge:URL" / "judge:OPTIONS.yaml" (a VLM judge; its options are read and checked here)."""
    if spec.startswith(REMOTE_PREFIX):
        return _FACTORIES["remote"], {"url": spec[len(REMOTE_PREFIX):]}
    if spec.startswith(JUDGE_PREFIX):
        return _FACTORIES["judge"], judge_options(spec[len(JUDGE_PREFIX):])
    name = _import_reward_module(spec) if ":" in spec else spec
    if name not in _FACTORIES:
        if "=" in spec or "," in spec:
            raise UnknownRewardError(f"reward {spec!r} is a mix: build it with "
                                     f"chunk_grpo.rewards.build_reward, not get_reward")
        where = f" after importing {spec.partition(':')[0]!r}" if spec != name else ""
        close = difflib.get_close_matches(name, available_rewards(), n=1)
        where += f" (did you mean {close[0]!r}?)" if close else ""
        raise UnknownRewardError(f"unknown reward {name!r}{where}; available: "
                                 f"{available_rewards()}. Register your own with "
                                 f"@register_reward('name') in a module and pass 'module:name'")
    return _FACTORIES[name], {}


def get_reward(name: str, **kwargs) -> Reward:
    """A new instance of the reward registered as `name` (or "module:name", importing the
    module first, "remote:URL" or "judge:..."), built with `kwargs`."""
    factory, fixed = reward_factory(name)
    return factory(**fixed, **kwargs)
