"""The reward spec: which rewards a run scores with, and their weights.

    shapes                              one registered reward (weight 1)
    my_rewards:redness                  a reward registered in your module
    remote:http://127.0.0.1:8000        a reward server (`python -m chunk_grpo.reward_server`)
    judge:http://127.0.0.1:8000         a VLM judge behind an OpenAI-compatible API
    judge:configs/judges/qwen2_5_vl_7b_yes_no.yaml   the same, its options in a YAML/JSON file
    pickscore=1.0,clip=0.5              a mix: the weighted sum of several rewards
    pickscore=1.0,my_rewards:redness=0.2,remote:http://127.0.0.1:8000=0.5

or a mapping (YAML ``reward: {pickscore: 1.0, clip: 0.5}``). Entries are split at commas; an
entry's weight is the number after its last ``=`` (no ``=``: weight 1), so the colons of
``module:name``, ``remote:URL`` and ``judge:...`` are never read as separators. This module
imports nothing heavy: the configuration checks a spec before any model or reward is loaded.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

_EXAMPLE = "e.g. 'pickscore=1.0,clip=0.5'"


class RewardSpecError(ValueError):
    """A reward spec that cannot be parsed; the message names the entry and the fix."""


def _weight(entry: str, text: str) -> float:
    try:
        weight = float(text)
    except ValueError:
        raise RewardSpecError(f"reward entry {entry!r}: the weight {text!r} after '=' is not a "
                              f"number; write name=weight, {_EXAMPLE}") from None
    if not math.isfinite(weight):
        raise RewardSpecError(f"reward entry {entry!r}: the weight must be finite, got {text!r}")
    return weight


def _entries_of_str(spec: str) -> list[tuple[str, float]]:
    entries = []
    for raw in spec.split(","):
        entry = raw.strip()
        if not entry:
            raise RewardSpecError(f"reward {spec!r} has an empty entry; separate name=weight "
                                  f"entries by single commas, {_EXAMPLE}")
        name, eq, weight = entry.rpartition("=")
        if not eq:
            name, weight = entry, "1"
        entries.append((name.strip(), _weight(entry, weight.strip())))
    return entries


def _entries_of_mapping(spec: Mapping) -> list[tuple[str, float]]:
    entries = []
    for name, weight in spec.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float, str)):
            raise RewardSpecError(f"reward {name!r}: the weight must be a number, got "
                                  f"{weight!r}; write {{name: weight}}, e.g. "
                                  f"{{pickscore: 1.0, clip: 0.5}}")
        entries.append((str(name).strip(), _weight(f"{name}: {weight}", str(weight))))
    return entries


def parse_reward_spec(spec: str | Mapping) -> list[tuple[str, float]]:
    """[(reward name, weight), ...] of a spec string or mapping (see the module docstring);
    RewardSpecError for an empty spec or entry, a missing name, a bad weight, a name given
    twice, or weights that are all zero."""
    if isinstance(spec, Mapping):
        entries = _entries_of_mapping(spec)
    elif isinstance(spec, str):
        if not spec.strip():
            raise RewardSpecError(f"reward is empty; name a registered reward or a mix, "
                                  f"{_EXAMPLE}")
        entries = _entries_of_str(spec)
    else:
        raise RewardSpecError(f"reward must be a name or a mapping of names to weights, got "
                              f"{type(spec).__name__} {spec!r}")
    if not entries:
        raise RewardSpecError(f"reward mapping is empty; give at least one name: weight, "
                              f"{_EXAMPLE}")
    seen = set()
    for name, _ in entries:
        if not name:
            raise RewardSpecError(f"reward spec {spec!r} has an entry without a name; write "
                                  f"name=weight, {_EXAMPLE}")
        if name.startswith("remote:") and not re.match(r"remote:https?://[^/:]+:\d+", name):
            raise RewardSpecError(f"reward {name!r}: a reward server is named "
                                  f"remote:http://HOST:PORT, e.g. remote:http://127.0.0.1:8000")
        if name.startswith("judge:") and not name[len("judge:"):].strip():
            raise RewardSpecError(f"reward {name!r}: name the judge's server or options file, "
                                  f"e.g. judge:http://127.0.0.1:8000 or judge:my_judge.yaml")
        if name in seen:
            raise RewardSpecError(f"reward {name!r} is named twice in {spec!r}; give each "
                                  f"reward once with its total weight")
        seen.add(name)
    if all(weight == 0 for _, weight in entries):
        raise RewardSpecError(f"reward {spec!r}: every weight is 0, so nothing is trained; give "
                              f"at least one reward a non-zero weight")
    return entries


def format_reward_spec(entries: list[tuple[str, float]]) -> str:
    """The spec string of parsed entries: a single reward of weight 1 is its name alone."""
    if len(entries) == 1 and entries[0][1] == 1.0:
        return entries[0][0]
    return ",".join(f"{name}={weight!r}" for name, weight in entries)


def reward_label(name: str) -> str:
    """A metric-safe label of a reward name (``reward/<label>_mean``): runs of characters other
    than letters, digits, '_', '.' and '-' become '_' (``my_rewards:redness`` ->
    ``my_rewards_redness``)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "reward"


# The guard the shapes world gets by default: its programmatic GenEval-like checks.
SHAPES_GUARD = "shapes"


def resolve_guard_spec(guard: str, *, reward: str, eval_prompts: str) -> str | None:
    """The spec of the guard reward a run scores beside the trained one (`eval.guard_reward`),
    or None for no guard. "none" turns it off; "auto" is the shapes world's checks when the
    evaluation prompts are a ``shapes:`` set and the trained reward is not those checks itself
    (its own evaluation already reports them), else no guard; anything else is a reward spec,
    as ``--reward`` takes it."""
    word = guard.strip().lower()
    if word == "none":
        return None
    if word == "auto":
        shapes_world = eval_prompts.startswith("shapes:")
        return SHAPES_GUARD if shapes_world and reward.strip() != SHAPES_GUARD else None
    return guard.strip()
