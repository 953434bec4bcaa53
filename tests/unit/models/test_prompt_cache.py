"""text_encoders: cache / cpu. Cached embeddings equal the online ones, are reused by a later run,
are keyed by the encoders, and an uncached prompt with freed encoders is a clear error."""

import pytest
import torch
from trainer_utils import save_tiny_flux

from chunk_grpo.models import FluxPolicy
from chunk_grpo.models.prompt_cache import (
    PromptCache,
    PromptCacheError,
    build_prompt_cache,
    setup_text_encoders,
)
from chunk_grpo.runtime.distributed import DistInfo

# tiny_config's default reward, registered for each test
pytestmark = pytest.mark.usefixtures("brightness_reward")

WORDS = "a one two red green blue circle circles square big".split()
PROMPTS = ["two red circles", "a big blue square", "one green circle", "two red circles"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_flux(tmp_path_factory.mktemp("tiny_flux"), WORDS)


def _assert_same(a, b):
    for name in ("prompt_embeds", "pooled", "text_ids"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=0, atol=1e-6)


def test_cached_embeddings_equal_the_online_ones_and_are_reused(model_dir, tmp_path):
    policy = FluxPolicy.from_pretrained(model_dir)
    online = policy.encode_prompts(PROMPTS)
    cache = build_prompt_cache(policy, PROMPTS, str(tmp_path), batch_size=2, progress=False)
    files = sorted(cache.directory.glob("*"))
    assert len(files) == 3 and all(f.suffix == ".safetensors" for f in files)  # distinct prompts
    _assert_same(cache.load(PROMPTS), policy.encode_with_text_encoders(PROMPTS))

    policy.prompt_cache = cache
    policy.free_text_encoders()
    assert policy.pipeline.text_encoder is None and policy.pipeline.text_encoder_2 is None
    _assert_same(policy.encode_prompts(PROMPTS), online)
    with pytest.raises(PromptCacheError, match="prompt 'a big red square' is not in the prompt "
                                               "cache .* text_encoders: cpu"):
        policy.encode_prompts(["a big red square"])

    # A later run with the same encoders encodes nothing: every prompt is found.
    again = FluxPolicy.from_pretrained(model_dir)
    stamps = {f: f.stat().st_mtime_ns for f in files}
    again.encode_with_text_encoders = None  # would fail if called
    reused = build_prompt_cache(again, PROMPTS, str(tmp_path), progress=False)
    assert reused.directory == cache.directory
    assert {f: f.stat().st_mtime_ns for f in files} == stamps


def test_the_key_follows_the_encoders_length_and_dtype(model_dir, tmp_path):
    base = PromptCache.for_policy(FluxPolicy.from_pretrained(model_dir), str(tmp_path))
    assert base.directory.parent == tmp_path
    shorter = FluxPolicy.from_pretrained(model_dir)
    shorter.max_sequence_length = shorter.max_sequence_length // 2
    bf16 = FluxPolicy.from_pretrained(model_dir, frozen_dtype=torch.bfloat16)
    other_weights = FluxPolicy.from_pretrained(
        save_tiny_flux(tmp_path / "seed1", WORDS, seed=1))
    keys = {PromptCache.for_policy(p, str(tmp_path)).directory
            for p in (shorter, bf16, other_weights)}
    assert base.directory not in keys and len(keys) == 3


def test_setup_caches_every_prompt_and_the_negative_then_frees(model_dir, tmp_path):
    policy = FluxPolicy.from_pretrained(model_dir)
    negative = policy.negative_embeds(1)
    setup_text_encoders(policy, "cache", PROMPTS[:2], str(tmp_path), DistInfo(), progress=False)
    assert not policy.has_text_encoders
    _assert_same(policy.negative_embeds(1), negative)  # CFG's unconditional prompt is cached
    policy.reload_text_encoders()  # e.g. for the final export
    assert policy.has_text_encoders
    assert not list(policy.prompt_cache.directory.glob("*.tmp"))  # atomic writes only


def test_a_reader_waits_for_the_writer_and_fails_on_a_missing_prompt(model_dir, tmp_path):
    writer = FluxPolicy.from_pretrained(model_dir)
    reader = FluxPolicy.from_pretrained(model_dir)
    calls = []
    build_prompt_cache(reader, PROMPTS, str(tmp_path), writer=False, progress=False,
                       wait=lambda: calls.append(build_prompt_cache(
                           writer, PROMPTS, str(tmp_path), progress=False)))
    assert len(calls) == 1  # the reader read what the writer wrote while it waited
    with pytest.raises(PromptCacheError, match="1 prompt.*'a big red square'.*prompt_cache_dir"):
        build_prompt_cache(reader, ["a big red square"], str(tmp_path), writer=False,
                           progress=False)


def test_an_unwritable_cache_directory_is_one_clear_error(model_dir, tmp_path):
    (tmp_path / "file").write_text("in the way")
    with pytest.raises(PromptCacheError, match="cannot write the prompt cache .* choose a "
                                               "writable prompt_cache_dir"):
        build_prompt_cache(FluxPolicy.from_pretrained(model_dir), PROMPTS,
                           str(tmp_path / "file" / "cache"), progress=False)


def test_cpu_text_encoders_move_only_the_embeddings(model_dir):
    policy = FluxPolicy.from_pretrained(model_dir, text_encoder_device="cpu")
    assert policy.pipeline.text_encoder_2.device.type == "cpu"
    _assert_same(policy.encode_prompts(PROMPTS), FluxPolicy.from_pretrained(
        model_dir).encode_prompts(PROMPTS))


def test_a_run_with_cached_prompts_trains_evaluates_and_exports(tiny_flux, tmp_path):
    from trainer_utils import tiny_config

    from chunk_grpo.train.loop import run
    from chunk_grpo.train.metrics import read_metrics

    model = tiny_flux
    train, heldout = tmp_path / "train.txt", tmp_path / "heldout.txt"
    train.write_text("a red circle\ntwo blue squares\n")
    heldout.write_text("a green triangle\n")
    cache_dir = tmp_path / "cache"
    cfg = tiny_config(model, tmp_path / "run", {"run.max_steps": 1, "model.lora_rank": 4,
                                                "eval.hybrid_steps": 2,
                                                "data.train_prompts": str(train),
                                                "data.eval_prompts": str(heldout),
                                                "model.text_encoders": "cache",
                                                "model.prompt_cache_dir": str(cache_dir)})
    out = run(cfg)
    record = read_metrics(out / "metrics.jsonl")[-1]
    assert "eval_hybrid/reward_mean" in record and "eval/gain_vs_base" in record
    (directory,) = cache_dir.iterdir()
    assert len(list(directory.glob("*.safetensors"))) == 4  # 2 + 1 prompts and the negative
    # The export has its text encoders back (reloaded from the model after being freed).
    exported = FluxPolicy.from_pretrained(out / "final_model")
    _assert_same(exported.encode_prompts(["a red circle"]),
                 FluxPolicy.from_pretrained(model).encode_prompts(["a red circle"]))
