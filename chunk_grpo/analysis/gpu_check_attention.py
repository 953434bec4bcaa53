"""FlashAttention against native attention at FLUX shapes (part of `chunk_grpo.analysis.gpu_check`).

Both through diffusers' attention dispatcher, as the trainer calls them (`attention_backend`:
"flash" when flash-attn is installed, else "native", torch's scaled_dot_product_attention):
24 heads of 128 and 4096 image + 512 text tokens (1024x1024), bf16, batch 1 (a rollout row)
and 11 (the preset's largest training call). Correctness: each backend's bf16 output against
torch's math attention in fp32 on the same inputs; FlashAttention's largest error may be at
most twice the native backend's plus one bf16 ulp of the output's scale (the rule of
flash-attention's own tests: both round q k^T, the softmax and p v to bf16 in their own order).
Speed: the median of CUDA-event-timed forward calls, and of forward + backward.
"""

from __future__ import annotations

import statistics

HEADS, HEAD_DIM, TOKENS = 24, 128, 4096 + 512
BATCHES = (1, 11)
ROUNDS, WARMUP = 20, 3
BF16_EPS = 2.0**-7  # one bf16 ulp at 1.0


def _median_ms(fn, rounds: int = ROUNDS) -> float:
    import torch

    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(rounds):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def compare(batch: int) -> dict:
    """One shape: errors against fp32 math attention, the tolerance, times and the verdict."""
    import torch
    from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(batch, TOKENS, HEADS, HEAD_DIM, device="cuda", generator=g,
                           dtype=torch.bfloat16).requires_grad_() for _ in range(3))

    def attend(backend, *qkv):
        return dispatch_attention_fn(*qkv, backend=AttentionBackendName(backend))

    with torch.no_grad():
        # Row by row: the math backend holds [heads, tokens, tokens] fp32 scores (2 GB a row).
        truth = torch.cat([attend("_native_math", *(t[i:i + 1].float() for t in (q, k, v)))
                           for i in range(batch)])
        errors = {name: (attend(name, q, k, v).float() - truth).abs().max().item()
                  for name in ("flash", "native")}
    tolerance = 2 * errors["native"] + BF16_EPS * truth.abs().max().item()
    grad = torch.randn_like(q)
    row = {"shape": [batch, TOKENS, HEADS, HEAD_DIM], "dtype": "bfloat16",
           "max_error": errors, "tolerance": tolerance, "ok": errors["flash"] <= tolerance}
    for name in ("flash", "native"):
        with torch.no_grad():
            row[f"{name}_forward_ms"] = _median_ms(lambda n=name: attend(n, q, k, v))
        row[f"{name}_full_ms"] = _median_ms(
            lambda n=name: torch.autograd.grad(attend(n, q, k, v), (q, k, v), grad))
    row["flash_speedup"] = row["native_full_ms"] / row["flash_full_ms"]
    return row


def check() -> tuple[str, str, dict]:
    """(status, reason, details): "skipped" when flash-attn is not installed."""
    try:
        import flash_attn
    except ImportError:
        return ("skipped", "flash_attn is not installed (pip install flash-attn "
                           "--no-build-isolation); the native SDPA path is used", {})
    rows = [compare(batch) for batch in BATCHES]
    ok = all(r["ok"] for r in rows)
    reason = "" if ok else "FlashAttention's error exceeds twice native attention's + 1 bf16 ulp"
    return ("pass" if ok else "fail", reason,
            {"flash_attn": getattr(flash_attn, "__version__", "?"), "cases": rows})
