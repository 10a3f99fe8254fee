"""The GDN operations' torch references (`ignition.capture.gdn`) against Transformers' `qwen3_5`
functions on identical operands, and the Triton kernels against the references under Triton's
CPU interpreter."""

from __future__ import annotations

from typing import Any

import pytest

from tests.ignition.conftest import require_torch
from tests.ignition.test_paged_cpu import _interpreted


def _hf() -> Any:
    require_torch()
    return pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")


def test_convolution_matches_transformers_prefill_and_decode() -> None:
    hf = _hf()
    import torch

    gen = torch.Generator().manual_seed(0)
    c, k, t = 12, 4, 9
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.randn(c, k, generator=gen).to(dtype)
        x = torch.randn(t, c, generator=gen).to(dtype)
        from ignition.capture.gdn import conv_reference

        # Prefill from an empty history: Transformers pads with zeros on the left.
        want = hf.causal_conv1d_fn(x.t()[None], w, None, activation="silu")[0].t()
        got, hist = conv_reference(x, torch.zeros(c, k - 1, dtype=dtype), w)
        # Summation order differs from F.conv1d's: float32 rounding (measured 3.6e-7 here); in
        # bf16 the rounded pre-activation absorbs it (measured equal), allowed one bf16 step.
        tol = 1e-6 if dtype == torch.float32 else 2**-7 * float(want.float().abs().max())
        assert float((got.float() - want.float()).abs().max()) <= tol, dtype
        # Decode: Transformers keeps the last K inputs; the history holds the last K-1.
        state = torch.cat([torch.zeros(c, 1, dtype=dtype), hist], 1)[None].clone()
        nxt = torch.randn(1, c, generator=gen).to(dtype)
        want1 = hf.causal_conv1d_update(nxt.t()[None], state, w, None, "silu")[0].t()
        got1, hist1 = conv_reference(nxt, hist, w)
        assert float((got1.float() - want1.float()).abs().max()) <= tol, dtype
        assert torch.equal(hist1, state[0, :, 1:])


def test_delta_rule_matches_transformers_recurrent_and_chunked() -> None:
    """The token-by-token reference equals Transformers' recurrent function (float32, same
    order of operations) and agrees with its chunked prefill within float32 rounding."""
    hf = _hf()
    import torch

    from ignition.capture.gdn import delta_rule_reference

    gen = torch.Generator().manual_seed(1)
    t, hk, hv, dk, dv = 70, 2, 4, 16, 8  # past one 64-token chunk
    q, k = torch.randn(t, hk, dk, generator=gen), torch.randn(t, hk, dk, generator=gen)
    v = torch.randn(t, hv, dv, generator=gen)
    g = -torch.rand(t, hv, generator=gen) * 0.5
    beta = torch.rand(t, hv, generator=gen)
    s0 = torch.randn(hv, dk, dv, generator=gen) * 0.1
    got, s = delta_rule_reference(s0, q, k, v, g, beta)
    args = (q[None], k[None], v[None], g[None], beta[None])
    rec, rec_s = hf.torch_recurrent_gated_delta_rule(
        *args, initial_state=s0[None], output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    assert torch.allclose(got, rec[0], atol=1e-6, rtol=0) and torch.allclose(s, rec_s[0], atol=1e-6, rtol=0)
    chunk, chunk_s = hf.torch_chunk_gated_delta_rule(
        *args, initial_state=s0[None], output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    assert float((got - chunk[0]).abs().max()) < 1e-4 and float((s - chunk_s[0]).abs().max()) < 1e-4
    # A prefix: the state after the first 40 tokens is the state of those 40 alone.
    _, s40 = delta_rule_reference(s0, q, k, v, g, beta, 40)
    _, alone = delta_rule_reference(s0, q[:40], k[:40], v[:40], g[:40], beta[:40])
    assert torch.equal(s40, alone)


def test_gdn_kernels_match_the_references_under_the_interpreter() -> None:
    """Convolution and delta rule kernels, decode and prefill (scan and chunked): outputs, states
    at the consumed length, padding lanes that write nothing, split scan prefill bitwise equal to
    whole, split chunked prefill within float32 rounding of whole; speculative lanes (convolution
    and delta rule) bitwise the decode kernels' steps, each lane's state in its column, and the
    commit copying exactly the accepted column into the live row."""
    report = _interpreted("gdn_interpreted.py", 300)
    assert report["exact_state_and_padding"] and report["split_bitwise"], report
    assert report["verify_lanes_bitwise_decode"] and report["commit_exact"], report
    assert report["max_abs_err"] < 1e-5 and report["state_max_abs_err"] < 1e-5, report
    assert report["chunked_max_abs_err"] < 1e-5 and report["chunked_split_vs_whole_max_abs_err"] < 1e-5, report


def test_gdn_ops_compile_in_place_without_copying_the_rows() -> None:
    """`flare::gdn_conv`, `flare::gdn_delta` and `flare::store_row` in a compiled layer loop
    (CPU, Triton's interpreter) update the continuation rows in place, equal to the eager
    references, beside another mutated buffer, with no rows-sized buffer in the compiled code."""
    report = _interpreted("gdn_compiled.py", 600)
    assert report["rows_sized_buffers"] == 0 and report["untouched_rows_bitwise"] and report["hist_equal"], report
    assert report["rows_max_abs_err"] < 1e-4 and report["out_max_abs_err"] < 1e-4, report
