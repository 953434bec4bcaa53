"""`chunk-grpo cache-prompts` (``python -m chunk_grpo.cache_prompts``): fill the prompt cache
once, before a run. It takes the flags of ``chunk-grpo train``; what it encodes and where is
`chunk_grpo.train.cache_prompts`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.parsing import build_config, parse_args

if TYPE_CHECKING:
    from chunk_grpo.models.prompt_cache import CacheFill

PROG = "python -m chunk_grpo.cache_prompts"


def main(argv: list[str] | None = None, prog: str = PROG) -> CacheFill:
    yaml_path, overrides, resume = parse_args(argv, prog=prog)
    if resume:
        raise ConfigError("cache_prompts takes the run's --config and flags, not --resume (a "
                          "resumed run reads the cache its first run filled)")
    cfg = build_config(yaml_path, overrides)
    from chunk_grpo.runtime import distributed as D  # torch: only once the config is good
    from chunk_grpo.train.cache_prompts import cache_prompts

    info = D.init_for_config(cfg)
    try:
        fill = cache_prompts(cfg, info)
    finally:
        D.cleanup(info)
    if info.is_main:
        print(f"[chunk-grpo] prompt cache {fill.cache.directory}: {fill.missing} encoded, "
              f"{fill.distinct - fill.missing} already cached ({fill.distinct} prompts)",
              flush=True)
        if cfg.model.text_encoders != "cache":
            print(f"[chunk-grpo] note: the run reads this cache only with text_encoders: cache "
                  f"(the config says {cfg.model.text_encoders})", flush=True)
    return fill
