"""The options of a VLM judge (`chunk_grpo.rewards.judge`) and the spec that names them.

    judge:http://127.0.0.1:8000          the server's base URL, every other option at its default
    judge:configs/judges/qwen2_5_vl_7b.yaml   a YAML or JSON file of options (base_url required)

Unknown keys, wrong types and impossible values are a RewardSpecError of one line naming the key
and the fix. It loads no model: the trainer checks a judge's options before any model
loads.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from chunk_grpo.config.reward_spec import RewardSpecError
from chunk_grpo.rewards.http_retry import split_http_url

JUDGE_PREFIX = "judge:"
SCORE_MODES = ("number", "yes_probability")
IMAGE_FORMATS = ("png", "jpeg")
DEFAULT_TEMPLATE = ('Does this image match the description "{prompt}"? '
                    'Answer with a single word, yes or no.')
_EXAMPLE = "e.g. judge:http://127.0.0.1:8000 or judge:configs/judges/qwen2_5_vl_7b_yes_no.yaml"


@dataclass
class JudgeOptions:
    """How a judge is asked and how its answer becomes a score (docs/guides/rewards.md)."""

    base_url: str = ""  # http(s)://HOST[:PORT][/PREFIX]; requests go to .../v1/chat/completions
    model: str = ""  # the served model name; "" = left out (a server with one model uses it)
    template: str = DEFAULT_TEMPLATE  # the user text; "{prompt}" is replaced by the prompt
    system: str = ""  # a system message; "" = none
    image_first: bool = True  # the image part before the text part of the user message
    image_format: str = "png"  # png (lossless) | jpeg
    jpeg_quality: int = 95
    max_tokens: int = 16
    temperature: float = 0.0
    extra_body: dict = field(default_factory=dict)  # more request fields, sent as given
    score: str = "yes_probability"  # yes_probability (from logprobs) | number (from the text)
    pattern: str = r"-?\d+(?:\.\d+)?"  # number: its last match (group 1 if it has groups)
    score_range: list[float] | None = None  # number: [lo, hi] -> (x - lo) / (hi - lo) in [0, 1]
    yes: str = "yes"  # yes_probability: the words, compared stripped and case-insensitively
    no: str = "no"
    top_logprobs: int = 20
    unparsed_score: float | None = None  # a reply without a score: None = error, else this
    api_key_env: str = "OPENAI_API_KEY"  # sent as a Bearer token when the variable is set
    max_concurrency: int = 8  # requests in flight at once
    timeout: float = 60.0  # seconds for the answer to each request
    connect_timeout: float = 5.0
    retries: int = 3  # more attempts on connection errors, timeouts, 429 and 5xx
    backoff: float = 0.5  # seconds before the first retry; doubled each time

    def __post_init__(self) -> None:
        _check_types(self)
        split_base_url(self.base_url)
        _check_values(self)

    @property
    def endpoint(self) -> str:
        """The chat-completions URL: base_url + /v1/chat/completions (a base ending in /v1 gets
        /chat/completions only, as OpenAI clients write it)."""
        return self.base_url.rstrip("/") + completions_suffix(self.base_url)


def completions_suffix(base_url: str) -> str:
    """What follows the base URL in the chat-completions URL (nothing doubles a /v1)."""
    return "/chat/completions" if base_url.rstrip("/").endswith("/v1") else "/v1/chat/completions"


def _field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(JudgeOptions)]


def _kind(value: Any, name: str, hint: str) -> bool:
    """Whether ``value`` fits the annotation ``hint`` of the option ``name``."""
    if value is None:
        return hint.endswith("| None")
    hint = hint.removesuffix(" | None")
    if hint == "bool":
        return isinstance(value, bool)
    if hint in ("int", "float"):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok and (hint == "float" or float(value).is_integer())
    if hint == "list[float]":
        return isinstance(value, (list, tuple)) and all(_kind(v, name, "float") for v in value)
    return isinstance(value, {"str": str, "dict": dict}[hint])


def _check_types(options: JudgeOptions) -> None:
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if not _kind(value, f.name, str(f.type)):
            raise RewardSpecError(f"judge option {f.name}: expects {f.type}, got {value!r}")


def _check_values(o: JudgeOptions) -> None:
    def bad(key: str, rule: str) -> RewardSpecError:
        return RewardSpecError(f"judge option {key} {rule}, got {getattr(o, key)!r}")

    if o.score not in SCORE_MODES:
        raise bad("score", f"must be one of {', '.join(SCORE_MODES)}")
    if o.image_format not in IMAGE_FORMATS:
        raise bad("image_format", f"must be one of {', '.join(IMAGE_FORMATS)}")
    for key, low in (("max_tokens", 1), ("max_concurrency", 1), ("top_logprobs", 1),
                     ("retries", 0), ("jpeg_quality", 1)):
        if getattr(o, key) < low:
            raise bad(key, f"must be >= {low}")
    for key in ("timeout", "connect_timeout"):
        if getattr(o, key) <= 0:
            raise bad(key, "must be > 0 seconds")
    if o.backoff < 0 or o.temperature < 0:
        raise bad("backoff" if o.backoff < 0 else "temperature", "must be >= 0")
    if o.score_range is not None and (len(o.score_range) != 2
                                      or not o.score_range[0] < o.score_range[1]):
        raise bad("score_range", "must be [lo, hi] with lo < hi, e.g. [1, 10]")
    try:
        compiled = re.compile(o.pattern)
    except re.error as err:
        raise bad("pattern", f"is not a regular expression ({err})") from None
    if compiled.groups > 1:
        raise bad("pattern", "may have at most one group (the number)")
    unknown = [p for p in re.findall(r"\{(\w+)\}", o.template) if p != "prompt"]
    if unknown:
        raise RewardSpecError(f"judge option template has the placeholder {{{unknown[0]}}}; the "
                              f"only placeholder is {{prompt}} (the image's prompt)")
    if not o.yes.strip() or not o.no.strip() or o.yes.strip().lower() == o.no.strip().lower():
        raise RewardSpecError(f"judge options yes and no must be two different words, got "
                              f"{o.yes!r} and {o.no!r}")


def split_base_url(url: str) -> tuple[str, str, int, str]:
    """(scheme, host, port, path prefix) of a judge's base URL, or RewardSpecError."""
    parts = split_http_url(url)
    if parts is None:
        raise RewardSpecError(f"judge base_url {url!r}: write http(s)://HOST[:PORT][/PREFIX] of "
                              f"an OpenAI-compatible server, {_EXAMPLE}")
    scheme, host, port, path = parts
    return scheme, host, port or (443 if scheme == "https" else 80), path


def judge_options(source: str, overrides: dict | None = None) -> dict[str, Any]:
    """The checked options of a judge spec's part after ``judge:`` (a base URL, or a YAML/JSON
    file of options), as keyword arguments of `JudgeOptions`; ``overrides`` win over the file."""
    source = source.strip()
    if source.startswith(("http://", "https://")):
        data: dict[str, Any] = {"base_url": source}
    elif source.endswith((".yaml", ".yml", ".json")):
        data = _read_options_file(Path(source))
    else:
        raise RewardSpecError(f"reward 'judge:{source}': name the judge's server or options "
                              f"file, {_EXAMPLE}")
    data.update(overrides or {})
    names = _field_names()
    for key in data:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; the options are {names}"
            raise RewardSpecError(f"unknown judge option {key!r} in {source!r}{hint}")
    if "base_url" not in data:
        raise RewardSpecError(f"judge options {source!r} have no base_url; add e.g. "
                              f"`base_url: http://127.0.0.1:8000`")
    JudgeOptions(**data)  # checked now, before any model loads
    return data


def _read_options_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise RewardSpecError(f"judge options file {str(path)!r} does not exist (a relative path "
                              f"is read from the directory you run from)")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))  # JSON is YAML too
    except (OSError, UnicodeDecodeError) as err:
        raise RewardSpecError(f"cannot read judge options file {str(path)!r} as UTF-8 text: "
                              f"{err}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise RewardSpecError(f"judge options file {str(path)!r}{where} is not valid YAML or "
                              f"JSON ({problem}); quote a template that holds quotes or colons "
                              f"with a block scalar `template: |-`") from None
    if not isinstance(data, dict):
        raise RewardSpecError(f"judge options file {str(path)!r} must hold a mapping of options, "
                              f"e.g. `base_url: http://127.0.0.1:8000`")
    return data
