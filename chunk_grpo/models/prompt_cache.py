"""Prompt embeddings computed once and cached on disk, so no text encoder stays in GPU memory.

T5-XXL is 4.7B parameters (9.5 GB in bf16, 19 GB in fp32) that only ever turn a prompt into the
same embeddings. With ``text_encoders: cache`` every prompt of the run (training, evaluation and
the unconditional prompt) is encoded once, batched, and written as one safetensors file per
prompt under

    <prompt_cache_dir>/<encoder key>/<sha256 of the prompt>.safetensors

The encoder key is a hash of everything the embeddings depend on: the text encoders' classes,
configs and a fingerprint of their weights, the tokenizers, the maximum sequence length and the
dtype. Another model, tokenizer, length or dtype gets another directory; a later run with the same
encoders reuses the files (only new prompts are encoded). Files are written atomically (a
temporary file, then a rename), so an interrupted run never leaves a half-written embedding.
Then the text encoders are freed and `FluxPolicy.encode_prompts` reads the files.

The ranks of a node split the encoding (`fill_prompt_cache`); ``python -m chunk_grpo.cache_prompts``
fills the cache once before a run, which then finds every prompt there and never moves the text
encoders to the GPU.

Size on disk: max_sequence_length x 4096 values per prompt for FLUX.1-dev (4 MB in bf16 at 512
tokens). ``text_encoders: cpu`` is the fallback that needs no disk: the encoders stay in CPU
memory and only their embeddings move to the GPU.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from chunk_grpo.config.errors import ConfigError
from chunk_grpo.models.policy import PromptEmbeds
from chunk_grpo.runtime import distributed as D

DEFAULT_CACHE_DIR = "~/.cache/chunk_grpo/prompt_embeds"
FORMAT_VERSION = 1
_FINGERPRINT_VALUES = 256  # leading values of every weight tensor hashed into the encoder key
_ENCODERS = (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2"))


class PromptCacheError(ConfigError):
    """A prompt is missing from the cache or a cache file is unreadable; says which and how."""


def cache_root(prompt_cache_dir: str) -> Path:
    """The configured directory ("" = ~/.cache/chunk_grpo/prompt_embeds)."""
    return Path(prompt_cache_dir or DEFAULT_CACHE_DIR).expanduser()


def _weights_fingerprint(module: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, param in module.state_dict().items():
        head = param.detach().flatten()[:_FINGERPRINT_VALUES].float().cpu()
        digest.update(f"{name}:{tuple(param.shape)}:{param.dtype}".encode())
        digest.update(head.numpy().tobytes())
    return digest.hexdigest()


def _tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        described = json.loads(backend.to_str())
        # The last call's truncation and padding settings are stored too: not an identity.
        described.pop("truncation", None)
        described.pop("padding", None)
    else:
        described = sorted(tokenizer.get_vocab().items())
    text = json.dumps(described, sort_keys=True)
    return hashlib.sha256(f"{type(tokenizer).__name__}:{text}".encode()).hexdigest()


def encoder_identity(policy) -> dict:
    """What the embeddings depend on, as JSON-able values (hashed into the cache key)."""
    pipeline = policy.pipeline
    identity = {"format": FORMAT_VERSION, "max_sequence_length": policy.max_sequence_length,
                "lowercase_t5": policy.lowercase_t5}
    for encoder_name, tokenizer_name in _ENCODERS:
        encoder = getattr(pipeline, encoder_name)
        config = {k: v for k, v in encoder.config.to_dict().items()
                  if k not in ("_name_or_path", "transformers_version", "dtype", "torch_dtype")}
        identity[encoder_name] = {
            "class": type(encoder).__name__,
            "dtype": str(next(encoder.parameters()).dtype),
            "config": config,
            "weights": _weights_fingerprint(encoder),
            "tokenizer": _tokenizer_fingerprint(getattr(pipeline, tokenizer_name)),
        }
    return identity


def encoder_key(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


def prompt_key(prompt: str) -> str:
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()


class PromptCache:
    """The cached embeddings of one set of text encoders: a directory of one file per prompt."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)

    @classmethod
    def for_policy(cls, policy, prompt_cache_dir: str = "") -> PromptCache:
        """The cache of ``policy``'s text encoders (they must still be loaded)."""
        if not policy.has_text_encoders:
            raise ValueError("the prompt cache's key needs the text encoders; build the cache "
                             "before freeing them")
        identity = encoder_identity(policy)
        return cls(cache_root(prompt_cache_dir) / encoder_key(identity)[:32])

    def path(self, prompt: str) -> Path:
        return self.directory / f"{prompt_key(prompt)}.safetensors"

    def missing(self, prompts: list[str]) -> list[str]:
        """The distinct prompts without a file, in first-seen order."""
        return [p for p in dict.fromkeys(prompts) if not self.path(p).is_file()]

    def write(self, prompts: list[str], embeds: PromptEmbeds) -> None:
        """One file per prompt, each written atomically (temp file, then rename)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for i, prompt in enumerate(prompts):
            tensors = {"prompt_embeds": embeds.prompt_embeds[i].detach().cpu().clone(),
                       "pooled": embeds.pooled[i].detach().cpu().clone(),
                       "text_ids": embeds.text_ids.detach().cpu().clone()}
            target = self.path(prompt)
            tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
            save_file(tensors, str(tmp), metadata={"prompt": prompt})
            os.replace(tmp, target)

    def load(self, prompts: list[str]) -> PromptEmbeds:
        """The cached embeddings of ``prompts`` (on the CPU, in the encoders' dtype)."""
        embeds, pooled, text_ids = [], [], None
        for prompt in prompts:
            path = self.path(prompt)
            if not path.is_file():
                raise PromptCacheError(
                    f"prompt {_short(prompt)} is not in the prompt cache {self.directory} and "
                    f"the text encoders were freed (text_encoders: cache); put it in "
                    f"train_prompts or eval_prompts so it is cached at start-up, or set "
                    f"text_encoders: cpu")
            try:
                with safe_open(str(path), framework="pt") as f:
                    stored = (f.metadata() or {}).get("prompt")
                    tensors = {k: f.get_tensor(k) for k in ("prompt_embeds", "pooled",
                                                            "text_ids")}
            except Exception as err:  # safetensors raises several types for a damaged file
                raise PromptCacheError(f"prompt cache file {path} is unreadable ({err}); delete "
                                       f"it and run again to re-encode that prompt") from None
            if stored != prompt:
                raise PromptCacheError(f"prompt cache file {path} holds {_short(stored or '')}, "
                                       f"not {_short(prompt)}; delete it and run again")
            embeds.append(tensors["prompt_embeds"])
            pooled.append(tensors["pooled"])
            text_ids = tensors["text_ids"]
        return PromptEmbeds(torch.stack(embeds), torch.stack(pooled), text_ids)


@dataclass
class CacheFill:
    """What `fill_prompt_cache` did: the cache, the distinct prompts asked for, how many were
    missing before, and how many of those this process encoded."""

    cache: PromptCache
    distinct: int
    missing: int
    encoded_here: int


def fill_prompt_cache(policy, prompts: list[str], prompt_cache_dir: str = "", *,
                      batch_size: int = 16, share: tuple[int, int] = (0, 1),
                      agree: Callable[[], None] = lambda: None,
                      wait: Callable[[], None] = lambda: None,
                      encode_device: torch.device | str | None = None,
                      progress: bool = True) -> CacheFill:
    """Encode the prompts the cache lacks and write them, split across the processes that
    share the work, then ``wait()`` and check that every prompt is there.

    ``share`` = (index, count): the missing prompts are cut into batches of ``batch_size`` in
    first-seen order, exactly as one process would, and process ``index`` encodes batches
    index, index + count, ...: the same batches, so the same files as one process writes.
    ``agree()`` (a barrier) runs after every process has listed what is missing and before
    anyone writes, so all split the same list; ``wait()`` (a barrier) after writing, so each
    then reads what the others wrote. ``encode_device``: where the text encoders move to
    encode, only when this process has prompts to encode (None: where they are)."""
    cache = PromptCache.for_policy(policy, prompt_cache_dir)
    todo = cache.missing(prompts)
    agree()
    index, count = share
    batches = [todo[start:start + batch_size] for start in range(0, len(todo), batch_size)]
    mine = batches[index::count] if count > 0 else []
    if mine and encode_device is not None:
        for name, _ in _ENCODERS:
            getattr(policy.pipeline, name).to(encode_device)
    total = sum(len(batch) for batch in mine)
    bar = tqdm(total=total, unit="prompt", desc="caching prompt embeddings",
               disable=not progress or not total)
    try:
        for batch in mine:
            cache.write(batch, policy.encode_with_text_encoders(batch))
            bar.update(len(batch))
    except OSError as err:
        raise PromptCacheError(f"cannot write the prompt cache {cache.directory}: "
                               f"{err.strerror or err}; choose a writable prompt_cache_dir "
                               f"with room for the embeddings, or text_encoders: cpu") from None
    finally:
        bar.close()
    wait()
    missing = cache.missing(prompts)
    if missing:
        raise PromptCacheError(f"{len(missing)} prompt(s) (e.g. {_short(missing[0])}) are not in "
                               f"{cache.directory} after the writing processes filled it; give "
                               f"every node a prompt_cache_dir it can read, or text_encoders: cpu")
    return CacheFill(cache, len(dict.fromkeys(prompts)), len(todo), total)


def build_prompt_cache(policy, prompts: list[str], prompt_cache_dir: str = "", *,
                       batch_size: int = 16, writer: bool = True,
                       wait: Callable[[], None] = lambda: None,
                       progress: bool = True) -> PromptCache:
    """One writer: encode the prompts the cache lacks and write them (if ``writer``), then
    ``wait()`` (a barrier: the other processes read what the writer wrote); returns the cache.
    Every process then checks that all ``prompts`` are there."""
    return fill_prompt_cache(policy, prompts, prompt_cache_dir, batch_size=batch_size,
                             share=(0, 1 if writer else 0), wait=wait, progress=progress).cache


def run_prompts(policy, prompts: list[str]) -> list[str]:
    """Everything a run encodes: its prompts and the unconditional prompt."""
    return [*prompts, policy.defaults.negative_prompt]


def node_share(info: D.DistInfo) -> tuple[int, int]:
    """This rank's share of the encoding: the ranks of a node split the work (each node fills
    its cache, so a node-local prompt_cache_dir works; on a shared one the nodes write the same
    files, each renamed into place atomically)."""
    return info.local_rank, D.local_world_size(info)


def setup_text_encoders(policy, mode: str, prompts: list[str], prompt_cache_dir: str,
                        info: D.DistInfo, *, batch_size: int = 16, progress: bool = True) -> None:
    """Apply ``text_encoders``: "keep" and "cpu" change nothing here (`text_encoder_device`
    placed them at load time); "cache" embeds ``prompts`` and the unconditional prompt once,
    split across the node's ranks (`node_share`), every rank then reading the whole cache, and
    frees the text encoders. They were loaded on the CPU: they move to the device only on a
    rank with prompts to encode, so a complete cache (`python -m chunk_grpo.cache_prompts`
    before the run) never puts them on the GPU."""
    if mode in ("keep", "cpu"):
        return
    if mode != "cache":
        raise ConfigError(f"text_encoders must be one of keep, cache, cpu; got {mode!r}")
    fill = fill_prompt_cache(
        policy, run_prompts(policy, prompts), prompt_cache_dir, batch_size=batch_size,
        share=node_share(info), agree=lambda: D.barrier(info), wait=lambda: D.barrier(info),
        encode_device=info.device, progress=progress and info.is_main)
    policy.prompt_cache = fill.cache
    policy.free_text_encoders()


def text_encoder_device(mode: str, device: torch.device) -> torch.device:
    """Where to load the text encoders: the CPU for ``text_encoders: cpu`` and ``cache`` (the
    cache's key is computed there; they move to ``device`` only to encode missing prompts),
    else ``device``."""
    return torch.device("cpu") if mode in ("cpu", "cache") else device


def _short(prompt: str, limit: int = 60) -> str:
    return repr(prompt if len(prompt) <= limit else prompt[:limit] + "...")
