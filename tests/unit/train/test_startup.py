"""Start-up that scales: prompt encoding split across ranks, the caching command, the
process-group timeout, the temporal profile measured once for the job, TF32; and the host reads
of a training iteration."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from spawn_ranks import run_ranks
from trainer_utils import tiny_config

from chunk_grpo.algorithm.dynamics import measure_dynamics, shared_dynamics
from chunk_grpo.cli.cache_prompts import main as cache_prompts_main
from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.parsing import build_config
from chunk_grpo.models import FluxPolicy
from chunk_grpo.models.prompt_cache import PromptCache, fill_prompt_cache
from chunk_grpo.runtime import distributed as D

# tiny_config's default reward, registered for each test
pytestmark = pytest.mark.usefixtures("brightness_reward")

PROMPTS = ["a red circle", "two blue squares", "one green triangle", "a big red square",
           "three small blue circles", "a green square", "two red triangles"]


def _files(cache: PromptCache) -> dict[str, dict[str, torch.Tensor]]:
    return {p.name: load_file(str(p)) for p in sorted(cache.directory.glob("*.safetensors"))}


def _fill_on_ranks(rank: int, world: int, tmp, model_dir, cache_dir):
    policy = FluxPolicy.from_pretrained(model_dir)
    fill = fill_prompt_cache(policy, PROMPTS, str(cache_dir), batch_size=2,
                             share=(rank, world), agree=dist.barrier, wait=dist.barrier,
                             progress=False)
    return fill.encoded_here, _files(fill.cache)


def test_prompt_encoding_split_on_two_ranks_writes_the_one_process_cache(tiny_flux, tmp_path):
    model = tiny_flux
    single = fill_prompt_cache(FluxPolicy.from_pretrained(model), PROMPTS,
                               str(tmp_path / "one"), batch_size=2, progress=False)
    assert (single.distinct, single.missing, single.encoded_here) == (7, 7, 7)
    results = run_ranks(_fill_on_ranks, 2, tmp_path, model, tmp_path / "two")
    # batches of 2 dealt round-robin: rank 0 encodes batches 0 and 2 (+ the last), rank 1 the rest
    assert [encoded for encoded, _ in results] == [4, 3]
    want = _files(single.cache)
    for _, files in results:  # every rank reads the whole cache, bit for bit the one-process one
        assert files.keys() == want.keys() and len(files) == 7
        for name, tensors in files.items():
            for key, value in tensors.items():
                assert torch.equal(value, want[name][key]), (name, key)


def test_a_complete_cache_never_moves_the_text_encoders(tiny_flux, tmp_path):
    model = tiny_flux
    fill_prompt_cache(FluxPolicy.from_pretrained(model), PROMPTS, str(tmp_path), progress=False)
    policy = FluxPolicy.from_pretrained(model)
    # "meta" would destroy the encoders if they moved: nothing to encode, so they stay put.
    fill = fill_prompt_cache(policy, PROMPTS, str(tmp_path), encode_device="meta",
                             progress=False)
    assert (fill.missing, fill.encoded_here) == (0, 0)
    assert policy.pipeline.text_encoder_2.device.type == "cpu"


def test_cache_prompts_then_the_run_never_encodes_a_prompt(tiny_flux, tmp_path, capsys,
                                                           monkeypatch):
    model = tiny_flux
    train, heldout = tmp_path / "train.txt", tmp_path / "heldout.txt"
    train.write_text("a red circle\ntwo blue squares\n")
    heldout.write_text("a green triangle\n")
    flags = ["--model.name", str(model), "--data.train_prompts", str(train),
             "--data.eval_prompts", str(heldout), "--model.text_encoders", "cache",
             "--model.prompt_cache_dir", str(tmp_path / "cache"), "--run.progress", "false"]
    fill = cache_prompts_main(flags)
    out = capsys.readouterr().out
    assert "4 encoded, 0 already cached (4 prompts)" in out  # 2 + 1 prompts and the negative
    assert fill.cache.directory.parent == tmp_path / "cache"
    cache_prompts_main(flags)
    assert "0 encoded, 4 already cached (4 prompts)" in capsys.readouterr().out

    def refuse(self, prompts):
        raise AssertionError(f"the run encoded {prompts} with the text encoders")

    monkeypatch.setattr(FluxPolicy, "encode_with_text_encoders", refuse)
    from chunk_grpo.train.loop import run
    cfg = tiny_config(model, tmp_path / "run", {"run.max_steps": 1, "model.lora_rank": 4,
                                                "data.train_prompts": str(train),
                                                "data.eval_prompts": str(heldout),
                                                "model.text_encoders": "cache",
                                                "model.prompt_cache_dir": str(tmp_path / "cache")})
    run(cfg)
    assert len(list(fill.cache.directory.glob("*.safetensors"))) == 4


def test_the_timeout_reaches_the_process_group_and_bad_values_are_one_line(monkeypatch):
    seen = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.update(kw))
    cfg = build_config(None, {"parallel.timeout_minutes": 7.5, "run.device": "cpu"})
    info = D.init_for_config(cfg)
    assert info.world_size == 2 and seen["timeout"] == timedelta(minutes=7.5)
    assert build_config().parallel.timeout_minutes == 60.0
    for bad in (0, -1):
        with pytest.raises(ConfigError, match=r"parallel.timeout_minutes must be > 0 minutes") \
                as err:
            build_config(None, {"parallel.timeout_minutes": bad})
        assert "\n" not in str(err.value)


def test_tf32_is_set_only_on_cuda_and_follows_the_key():
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    # saved and restored by hand: torch 2.14 serves matmul.allow_tf32 through a property that
    # pytest's monkeypatch cannot undo
    saved = matmul.allow_tf32, cudnn.allow_tf32
    try:
        matmul.allow_tf32 = cudnn.allow_tf32 = False
        assert not D.set_tf32(True, torch.device("cpu"))
        assert not matmul.allow_tf32 and not cudnn.allow_tf32  # a CPU run changes nothing
        assert D.set_tf32(True, torch.device("cuda", 0))
        assert matmul.allow_tf32 and cudnn.allow_tf32
        assert D.set_tf32(False, torch.device("cuda", 0))
        assert not matmul.allow_tf32 and not cudnn.allow_tf32
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = saved
    assert build_config().model.tf32 is True
    assert build_config(None, {"model.tf32": "false"}).model.tf32 is False


PROFILE = dict(num_steps=6, shift=3.0, seed=3, batch_size=2, mixed_precision="no")


def _profile_on_ranks(rank: int, world: int, tmp, model_dir):
    policy = FluxPolicy.from_pretrained(model_dir)
    info = D.DistInfo(rank=rank, world_size=world)
    calls = []
    forward = policy.velocity
    policy.velocity = lambda *a, **k: calls.append(1) or forward(*a, **k)
    sharded = shared_dynamics(policy, PROMPTS[:5], info=info, sharded=True, **PROFILE)
    sharded_calls = len(calls)
    broadcast = shared_dynamics(policy, PROMPTS[:5], info=info, sharded=False, **PROFILE)
    return sharded, sharded_calls, broadcast, len(calls) - sharded_calls


def test_the_profile_on_two_ranks_equals_the_one_process_curve(tiny_flux, tmp_path):
    model = tiny_flux
    want = measure_dynamics(FluxPolicy.from_pretrained(model), PROMPTS[:5], **PROFILE)
    results = run_ranks(_profile_on_ranks, 2, tmp_path, model)
    (s0, c0, b0, n0), (s1, c1, b1, n1) = results
    # FSDP: 5 prompts as 3 + 2, in batches of 2: two denoise calls each (6 steps x 2 calls)
    assert c0 == c1 == 12
    # The same trajectories in other batches, summed in fp64: equal up to the transformer's
    # reduction order over a batch of another size (measured: 3e-8 relative).
    torch.testing.assert_close(s0, want, rtol=1e-5, atol=1e-7)
    assert torch.equal(s0, s1)
    # DDP / none: rank 0 alone measures (3 batches x 6 steps), everyone gets its exact curve
    assert (n0, n1) == (18, 0)
    assert torch.equal(b0, want) and torch.equal(b1, want)


def _counting(original, counts: dict, updating: list[bool]):
    def counted(self, *args, **kwargs):
        counts["all"] += 1
        counts["update"] += updating[0]
        return original(self, *args, **kwargs)
    return counted


def _reads_per_iteration(model, tmp_path, monkeypatch, micro_batch_size: int) -> tuple[int, int]:
    """(host reads of one whole iteration, of its update: gradients and optimizer steps) with
    every tensor-to-Python conversion counted."""
    from chunk_grpo.train import loop as train

    cfg = tiny_config(model, tmp_path / f"run{micro_batch_size}",
                      {"optim.micro_batch_size": micro_batch_size, "chunks.fraction": 1.0})
    tr = train.build_trainer(cfg, tmp_path / f"run{micro_batch_size}", D.init_distributed("cpu"))
    counts = {"all": 0, "update": 0}
    updating = [False]
    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "__float__", "__bool__", "__int__"):
            patch.setattr(torch.Tensor, name, _counting(getattr(torch.Tensor, name), counts,
                                                         updating))
        accumulate = train.accumulate_gradients

        def accumulate_counted(*args, **kwargs):
            updating[0] = True
            yield from accumulate(*args, **kwargs)
            updating[0] = False

        patch.setattr(train, "accumulate_gradients", accumulate_counted)
        metrics, finite = train.train_iteration(tr, 0)
    assert finite and metrics["optimizer_steps"] == 1
    return counts["all"], counts["update"]


def test_host_reads_per_iteration_do_not_grow_with_the_micro_batches(tiny_flux, tmp_path,
                                                                    monkeypatch):
    # 8 rows: one micro-batch of 8, or four of 2; one optimizer step (grad_accum 0) either way
    one = _reads_per_iteration(tiny_flux, tmp_path, monkeypatch, 8)
    four = _reads_per_iteration(tiny_flux, tmp_path, monkeypatch, 2)
    assert one == four
    # the update reads the schedule's s_1 (a CPU tensor, no device sync), the step's skip
    # decision and, once, every loss, statistic and norm
    assert four[1] == 3
