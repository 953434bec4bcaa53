"""A VLM judge behind an OpenAI-compatible chat-completions API (vLLM, SGLang, ...) as a reward:
``--reward.name judge:http://HOST:PORT`` or ``--reward.name judge:OPTIONS.yaml``
(`judge_options`).

Each image is one request, ``POST {base_url}/v1/chat/completions``: a user message with the image
(a PNG or JPEG ``data:`` URL in an ``image_url`` part) and the template's text with the prompt,
after an optional system message; temperature 0. The score is read from the answer:

- ``yes_probability``: the first generated token's ``top_logprobs`` (asked for with
  ``logprobs: true``): p(yes) / (p(yes) + p(no)), each summed over the tokens that are the word
  once stripped and lower-cased (" Yes", "yes", "YES"). A reply without logprobs is an error.
- ``number``: the last match of ``pattern`` in the reply text (its group, if it has one),
  mapped from ``score_range`` [lo, hi] to [0, 1] (clamped) when given.

At most ``max_concurrency`` requests are in flight. A connection error, a timeout, 429 or 5xx is
retried ``retries`` times with exponential backoff; then a `RewardUnavailableError` names the
endpoint and the fix. A reply with no score is a `RewardOutputError` (or ``unparsed_score``).
The scores are pointwise: the reward sees rollout batches, which need not hold whole groups,
so a pairwise (win-rate) judge is not offered.
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor

import torch
from PIL import Image

from chunk_grpo.rewards.http_retry import RetriesExhausted, send, with_retries
from chunk_grpo.rewards.judge_options import JudgeOptions, completions_suffix, split_base_url
from chunk_grpo.rewards.outputs import RewardOutputError, RewardUnavailableError
from chunk_grpo.rewards.registry import register_reward

_RETRY_STATUSES = (429, 500, 502, 503, 504)


def image_data_url(image: torch.Tensor, image_format: str = "png", quality: int = 95) -> str:
    """A ``data:image/...;base64,`` URL of one image [3, H, W] in [0, 1], rounded to 8 bits."""
    pixels = (image.detach().float().nan_to_num(0.5).clamp(0, 1) * 255).round().to(torch.uint8)
    buffer = io.BytesIO()
    picture = Image.fromarray(pixels.permute(1, 2, 0).cpu().numpy())
    if image_format == "jpeg":
        picture.save(buffer, format="JPEG", quality=quality)
    else:
        picture.save(buffer, format="PNG")
    return f"data:image/{image_format};base64,{base64.b64encode(buffer.getvalue()).decode()}"


def _yes_probability(choice: dict, o: JudgeOptions) -> float | None:
    """p(yes) / (p(yes) + p(no)) of the first generated token; None when neither is among its
    top_logprobs; RewardOutputError when the reply has no logprobs at all."""
    try:
        top = choice["logprobs"]["content"][0]["top_logprobs"]
        pairs = [(str(t["token"]), float(t["logprob"])) for t in top]
    except (KeyError, IndexError, TypeError, ValueError):
        raise RewardOutputError(
            f"judge {o.endpoint} sent no top_logprobs for the first token (score: "
            f"yes_probability needs them); serve a model whose server returns logprobs (vLLM: "
            f"--max-logprobs >= {o.top_logprobs}) or use `score: number`") from None
    yes, no = o.yes.strip().lower(), o.no.strip().lower()
    p_yes = sum(math.exp(lp) for token, lp in pairs if token.strip().lower() == yes)
    p_no = sum(math.exp(lp) for token, lp in pairs if token.strip().lower() == no)
    return p_yes / (p_yes + p_no) if p_yes + p_no > 0 else None


def _number(text: str, o: JudgeOptions) -> float | None:
    """The last match of ``pattern`` in ``text`` (its group if any), normalised by
    ``score_range``; None when there is none."""
    matches = list(re.finditer(o.pattern, text))
    if not matches:
        return None
    last = matches[-1]
    try:
        value = float(last.group(1) if last.re.groups else last.group(0))
    except (TypeError, ValueError):
        return None
    if o.score_range is not None:
        lo, hi = (float(v) for v in o.score_range)
        value = min(max((value - lo) / (hi - lo), 0.0), 1.0)
    return value


def parse_score(reply: dict, o: JudgeOptions) -> float:
    """The score of one chat-completions reply (see the module docstring)."""
    try:
        choice = reply["choices"][0]
        text = choice["message"]["content"] or ""
    except (KeyError, IndexError, TypeError):
        raise RewardOutputError(f"judge {o.endpoint} sent a reply without choices[0].message."
                                f"content: {json.dumps(reply)[:200]}; is it an OpenAI-compatible "
                                f"chat-completions server?") from None
    if o.score == "yes_probability":
        value = _yes_probability(choice, o)
        missing = (f"neither {o.yes!r} nor {o.no!r} is among the first token's top "
                   f"{o.top_logprobs} (reply {text[:80]!r}); make the template ask for a yes/no "
                   f"answer")
    else:
        value = _number(str(text), o)
        missing = (f"the reply {text[:120]!r} has no match of pattern {o.pattern!r}; make the "
                   f"template ask for the score in that form or change the pattern")
    if value is None:
        if o.unparsed_score is None:
            raise RewardOutputError(f"judge {o.endpoint}: {missing} (or set unparsed_score)")
        return float(o.unparsed_score)
    return value


@register_reward("judge")
class VLMJudge:
    """Scores each image by asking a VLM judge over HTTP; see the module docstring."""

    def __init__(self, base_url: str | None = None, *, device: object = None,
                 dtype: object = None, **options):
        # device and dtype (which build_reward gives every factory that takes **options) place
        # local models; the judge's model lives on its server
        if not base_url:
            raise ValueError("a judge needs its server: write judge:http://HOST:PORT or "
                             "judge:OPTIONS.yaml (reward), or get_reward('judge', base_url=...)")
        self.options = JudgeOptions(base_url=base_url, **options)
        self.scheme, self.host, self.port, prefix = split_base_url(base_url)
        self.path = prefix + completions_suffix(base_url)

    def request_body(self, image: torch.Tensor, prompt: str) -> dict:
        """The chat-completions request of one image and its prompt."""
        o = self.options
        picture = {"type": "image_url",
                   "image_url": {"url": image_data_url(image, o.image_format, o.jpeg_quality)}}
        text = {"type": "text", "text": o.template.replace("{prompt}", prompt)}
        messages = [{"role": "system", "content": o.system}] if o.system else []
        messages.append({"role": "user",
                         "content": [picture, text] if o.image_first else [text, picture]})
        body = {"messages": messages, "max_tokens": o.max_tokens, "temperature": o.temperature}
        if o.model:
            body["model"] = o.model
        if o.score == "yes_probability":
            body.update(logprobs=True, top_logprobs=o.top_logprobs)
        body.update(o.extra_body)
        return body

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.options.api_key_env, "") if self.options.api_key_env else ""
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def ask(self, image: torch.Tensor, prompt: str) -> dict:
        """The decoded JSON reply to one image's request (with retries)."""
        o = self.options
        payload = json.dumps(self.request_body(image, prompt)).encode()
        headers = self._headers()
        try:
            status, data = with_retries(
                lambda: send(self.scheme, self.host, self.port, "POST", self.path, payload,
                             headers, o.connect_timeout, o.timeout),
                retries=o.retries, backoff=o.backoff, retry_statuses=_RETRY_STATUSES)
        except RetriesExhausted as err:
            fix = {"timeout": f"raise the judge's timeout (now {o.timeout:g} s) or lower "
                              f"max_concurrency (now {o.max_concurrency})",
                   "status": f"the server is overloaded or failing: lower max_concurrency (now "
                             f"{o.max_concurrency}) or raise retries and backoff",
                   "connection": "start the server (e.g. `vllm serve MODEL --port PORT`) or fix "
                                 "base_url"}[err.kind]
            raise RewardUnavailableError(f"judge {o.endpoint} did not answer after "
                                         f"{err.attempts} attempts (last: {err.last}); {fix}"
                                         ) from None
        if status != 200:
            raise RewardOutputError(f"judge {o.endpoint} answered HTTP {status}: "
                                    f"{_error_message(data)}" + (
                                        f"; set the API key in ${o.api_key_env}"
                                        if status in (401, 403) else ""))
        try:
            return json.loads(data)
        except ValueError:
            raise RewardOutputError(f"judge {o.endpoint} sent a reply that is not JSON: "
                                    f"{data[:120]!r}") from None

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        prompts = list(prompts)
        if images.ndim != 4 or images.shape[1] != 3 or images.shape[0] != len(prompts):
            raise ValueError(f"images must be [B, 3, H, W] with B = {len(prompts)} prompts, got "
                             f"{tuple(images.shape)}")
        if not prompts:
            return torch.zeros(0)
        images = images.cpu()
        workers = min(self.options.max_concurrency, len(prompts))
        pool = ThreadPoolExecutor(workers, "judge")
        try:
            futures = [pool.submit(self.score_one, images[i], p) for i, p in enumerate(prompts)]
            scores = [f.result() for f in futures]
        finally:  # the first failure stops the requests not yet sent
            pool.shutdown(wait=True, cancel_futures=True)
        return torch.tensor(scores, dtype=torch.float32)

    def score_one(self, image: torch.Tensor, prompt: str) -> float:
        return parse_score(self.ask(image, prompt), self.options)


def _error_message(data: bytes) -> str:
    """The message of an OpenAI-style ({"error": {"message"}}) or vLLM-style ({"message"})
    error body, else its first 200 bytes."""
    try:
        body = json.loads(data)
        error = body.get("error", body)
        message = error.get("message") if isinstance(error, dict) else error
        if message:
            return str(message).splitlines()[0][:300]
    except (ValueError, AttributeError):
        pass
    return data[:200].decode(errors="replace")
