"""mixed_precision: auto picks bf16 only where the hardware runs it natively."""

import pytest
import torch

from chunk_grpo.algorithm.rollout import autocast_context
from chunk_grpo.runtime import precision
from chunk_grpo.runtime.precision import cpu_flags, cpu_has_native_bf16, resolve_mixed_precision

AVX2_CPUINFO = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse sse2 avx avx2 fma\n"
SPR_CPUINFO = "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16\n"
AVX512_NO_BF16 = "flags\t\t: fpu avx2 avx512f avx512bw avx512_vnni\n"
ARM_BF16 = "Features\t: fp asimd evtstrm aes sve bf16 i8mm\n"
ARM_OLD = "Features\t: fp asimd evtstrm aes crc32\n"


@pytest.mark.parametrize("cpuinfo, native", [
    (AVX2_CPUINFO, False), (SPR_CPUINFO, True), (AVX512_NO_BF16, False),
    (ARM_BF16, True), (ARM_OLD, False), ("model name : mystery\n", None),
])
def test_native_bf16_is_read_from_the_cpu_flags(cpuinfo, native):
    assert cpu_has_native_bf16(cpu_flags(cpuinfo)) is native


@pytest.fixture
def fresh_auto_cache():
    precision._auto_choice.cache_clear()
    yield
    precision._auto_choice.cache_clear()


@pytest.mark.parametrize("cpuinfo, mode", [(AVX2_CPUINFO, "no"), (SPR_CPUINFO, "bf16")])
def test_auto_follows_the_flags_and_says_why(monkeypatch, fresh_auto_cache, cpuinfo, mode):
    monkeypatch.setattr(precision, "cpu_flags", lambda: cpu_flags(cpuinfo))
    choice = resolve_mixed_precision("auto", "cpu")
    assert choice.mode == mode
    assert "native bf16" in choice.reason


@pytest.mark.parametrize("faster, mode", [(True, "bf16"), (False, "no")])
def test_unreadable_flags_fall_back_to_the_micro_benchmark(monkeypatch, fresh_auto_cache,
                                                           faster, mode):
    monkeypatch.setattr(precision, "cpu_flags", lambda: None)
    monkeypatch.setattr(precision, "bf16_faster_by_benchmark", lambda: (faster, 2e-3, 1e-3))
    choice = resolve_mixed_precision("auto", "cpu")
    assert choice.mode == mode and "measured" in choice.reason


def test_micro_benchmark_is_quick_and_returns_timings():
    faster, fp32_s, bf16_s = precision.bf16_faster_by_benchmark(size=64, repeats=2)
    assert isinstance(faster, bool) and fp32_s > 0 and bf16_s > 0


def test_explicit_modes_are_kept_and_bad_ones_refused(monkeypatch):
    monkeypatch.setattr(precision, "cpu_flags", lambda: cpu_flags(AVX2_CPUINFO))
    assert resolve_mixed_precision("no", "cpu").mode == "no"
    slow = resolve_mixed_precision("bf16", "cpu")
    assert slow.mode == "bf16" and "slower" in slow.reason
    with pytest.raises(ValueError, match="mixed_precision must be one of"):
        resolve_mixed_precision("fp16", "cpu")


def test_autocast_context_resolves_auto(monkeypatch, fresh_auto_cache):
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    for cpuinfo, dtype in ((AVX2_CPUINFO, torch.float32), (SPR_CPUINFO, torch.bfloat16)):
        precision._auto_choice.cache_clear()
        monkeypatch.setattr(precision, "cpu_flags", lambda c=cpuinfo: cpu_flags(c))
        with autocast_context(torch.device("cpu"), "auto"):
            assert layer(x).dtype == dtype
