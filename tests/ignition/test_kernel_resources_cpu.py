"""The kernels whose launch configuration depends on the model's geometry, compiled for sm_90 by
this machine's Triton (no GPU needed: `triton.compile` with an explicit signature, then
`cuobjdump -res-usage` on the cubin), at the recipes' real geometries: the prefill attention
must fit a Hopper block's shared memory, and the GDN chunked prefill must not spill registers.
Both failures only show on a device otherwise: a launch error at preparation, or a kernel many
times slower (the first chunked GDN kernel spilled 7 KB of stack per thread and ran 5.7x slower
than the token scan). The compiler here may be newer than the device's (Triton 3.9 here, 3.6
there, 2026-12): these are this compiler's figures, a guard against regressions."""

from __future__ import annotations

import os
import re
import subprocess
from typing import Any

import pytest

triton = pytest.importorskip("triton")

# The most dynamic shared memory one block may use on sm_90 (227 KB).
SM90_SHARED = 232448


def compile_kernel(fn: Any, signature: dict[str, str], constants: dict[str, Any], **options: int) -> Any:
    """`fn` compiled for sm_90 (a `CompiledKernel`: `asm` holds each stage's text and the cubin)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    if not (os.path.exists(os.path.join(bin_dir, "cuobjdump")) and os.path.exists(os.path.join(bin_dir, "ptxas"))):
        pytest.skip("this Triton ships no ptxas or cuobjdump")
    sig = {**signature, **dict.fromkeys(constants, "constexpr")}
    return triton.compile(ASTSource(fn, sig, constants), target=GPUTarget("cuda", 90, 32), options=options)


def compile_sm90(fn: Any, signature: dict[str, str], constants: dict[str, Any], **options: int) -> dict[str, int]:
    """Registers, stack bytes per thread and shared bytes of `fn` compiled for sm_90."""
    kernel = compile_kernel(fn, signature, constants, **options)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"flare_{fn.__name__}_{os.getpid()}.cubin")
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])
    try:
        out = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(path)
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    assert m, out
    return {"registers": int(m.group(1)), "stack": int(m.group(2)), "shared": int(kernel.metadata.shared)}


def signature(pointers: dict[str, str], ints: list[str]) -> dict[str, str]:
    return {**{k: "*" + v for k, v in pointers.items()}, **dict.fromkeys(ints, "i32")}


# Pointer parameters both attention kernels take, by element type.
ATTENTION_POINTERS = {"Q": "bf16", "COS": "fp32", "SIN": "fp32", "KV": "bf16", "PT": "i32", "REQ": "i32", "POS": "i32"}
# (name, heads, KV heads, head dim, RoPE in the kernel): the ~1B Llama, SmolLM2, Qwen3.5-0.8B.
ATTENTION = (("llama_1b", 32, 8, 64, True), ("smollm2", 9, 3, 64, True), ("qwen3_5_0p8b", 8, 2, 256, False))


@pytest.mark.parametrize(("name", "heads", "kv_heads", "d", "rope"), ATTENTION)
def test_prefill_attention_fits_sm90(name: str, heads: int, kv_heads: int, d: int, rope: bool) -> None:
    from ignition.capture import attention, attention_triton

    g = heads // kv_heads
    gp = 1 << (g - 1).bit_length()
    bt, warps, stages = attention.prefill_block_config(gp, d)
    sig = signature(
        {**ATTENTION_POINTERS, "OUT": "bf16"},
        ["layer", "N", "q_row", "q_head", "s_page", "s_layer", "s_sel", "s_tok", "s_head", "pt_stride", "pt_cols"],
    )
    consts = {"SCALE": d**-0.5, "H": heads, "G": g, "GP": gp, "D": d, "T": 64, "BT": bt, "ROPE": rope}
    res = compile_sm90(attention_triton.paged_prefill_attention_kernel, sig, consts, num_warps=warps, num_stages=stages)
    assert res["shared"] <= SM90_SHARED, (name, res)


def test_chunked_gdn_prefill_does_not_spill() -> None:
    """The three chunked-prefill kernels at Qwen3.5-0.8B's GDN geometry (16 heads of 128), with
    the block sizes `delta_rule_prefill_chunked` launches them with."""
    from ignition.capture import gdn_triton

    dims = {"HK": 16, "HV": 16, "DK": 128, "DV": 128, "C": 32, "KB": 32}
    scratch = dict.fromkeys(("U", "WK", "KD", "QK", "GAMMA", "DECAY"), "fp32")
    prep = signature(
        {"LENGTH": "i32", "Q": "bf16", "K": "bf16", "V": "bf16", "G": "fp32", "BETA": "fp32", **scratch},
        ["NC", "sq_t", "sq_h", "sk_t", "sk_h", "sv_t", "sv_h", "sg_t"],
    )
    state = signature(
        {"STATE": "fp32", "ROW": "i32", "LENGTH": "i32", **dict.fromkeys(("U", "WK", "KD", "DECAY", "W", "H"), "fp32")},
        ["NC", "ss_r", "ss_h", "ss_k"],
    )
    output = signature(
        {"LENGTH": "i32", "Q": "bf16", **dict.fromkeys(("QK", "GAMMA", "W", "H"), "fp32"), "OUT": "bf16"},
        ["NC", "T", "sq_t", "sq_h", "so_t", "so_h"],
    )
    state_dims = {k: dims[k] for k in ("DK", "DV", "C", "KB")}
    results = {
        "prep": compile_sm90(gdn_triton.delta_rule_chunk_prep_kernel, prep, dims, num_warps=8),
        "state": compile_sm90(gdn_triton.delta_rule_chunk_state_kernel, state, {**state_dims, "BV": 32}, num_warps=8),
        "output": compile_sm90(gdn_triton.delta_rule_chunk_output_kernel, output, {**dims, "BV": 32}),
    }
    for name, res in results.items():
        assert res["stack"] == 0 and res["shared"] <= SM90_SHARED, (name, res)


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize(("name", "heads", "kv_heads", "d", "rope"), [*ATTENTION, ("head_dim_128", 16, 4, 128, True)])
def test_decode_attention_fits_sm90(name: str, heads: int, kv_heads: int, d: int, rope: bool, pdl: bool) -> None:
    """The decode attention kernel as `_launch_attention` launches it (a write inside, 72-page
    tables in groups of `PAGES_PER_SPLIT`, plainly and as a programmatic dependent): at head dim
    64 no stack; above it no more than 512 bytes (at 256 the ~480 bytes it spilled before the
    page ids were loaded per group, where a page-offset tile held across the loop once took
    4,960)."""
    from ignition.capture import attention, attention_triton

    g = heads // kv_heads
    pps = attention.PAGES_PER_SPLIT
    pointers = {"PACC": "fp32", "PM": "fp32", "PL": "fp32", "OUT": "bf16", "K": "bf16", "V": "bf16", "SLOT": "i64"}
    ints = ["layer", "q_row", "q_head", "k_row", "k_head", "v_row", "v_head"]
    sig = signature(
        {**ATTENTION_POINTERS, **pointers}, [*ints, "s_page", "s_layer", "s_sel", "s_tok", "s_head", "pt_stride"]
    )
    consts = {"SCALE": d**-0.5, "H": heads, "G": g, "GP": max(16, 1 << (g - 1).bit_length()), "D": d, "T": 64}
    consts |= {"SPLITS": -(-72 // pps), "PPS": pps, "PPSP": max(2, 1 << (pps - 1).bit_length())}
    consts |= {"ROPE": rope, "WRITE": True, "PDL": pdl}
    res = compile_sm90(attention_triton.paged_attention_kernel, sig, consts, num_warps=4)
    assert res["stack"] <= (0 if d <= 64 else 512) and res["shared"] <= SM90_SHARED, (name, res)


@pytest.mark.parametrize(("name", "heads", "kv_heads", "d", "rope"), ATTENTION)
def test_attention_combine_does_not_spill_at_the_widest_split(
    name: str, heads: int, kv_heads: int, d: int, rope: bool
) -> None:
    """The combine over the most page groups preparation's tuner allows (`MAX_SPLITS`, one page
    per group): each (token, head) holds every group's partial output. At head dim 64 that must
    not spill; at 256 (128 x 256 floats over 128 threads) this compiler spills 64 bytes, no more
    (on the H100 one page per group over 72-page tables, the same 128-wide tile, was still the
    fastest setting at Qwen3.5's geometry for one request, 2026-12-06)."""
    from ignition.capture import attention_triton, attention_tune

    splits = attention_tune.MAX_SPLITS
    sig = signature({"PACC": "fp32", "PM": "fp32", "PL": "fp32", "OUT": "bf16", "POS": "i32"}, [])
    consts = {
        "H": heads,
        "D": d,
        "T": 64,
        "PPS": 1,
        "SPLITS": splits,
        "SP": 1 << (splits - 1).bit_length(),
        "PDL": False,
    }
    res = compile_sm90(attention_triton.paged_attention_combine, sig, consts, num_warps=4)
    assert res["stack"] <= (0 if d <= 64 else 64), (name, res)


def test_fused_sampler_kernels_do_not_spill() -> None:
    """`flare::sample`'s four kernels at the widths `sampling.launch` uses: the chunked passes
    and the one program per row (wide blocks, a cumulative sum and histograms per block) keep
    their running values in registers and fit a block's shared memory."""
    from ignition.capture import sampling, sampling_triton

    # Pointer element types by parameter name (`NAME_ptr`); every other parameter is an int32.
    types = {"logits": "bf16", "hist": "i32", "hist_rows": "i64", "grammar": "i32", "topk": "i32"}
    types |= dict.fromkeys(("seed", "counter", "tok"), "i64")
    types |= dict.fromkeys(("wins", "counts", "counts1", "cand"), "i32") | {"allowed": "i1"}
    constexprs = {"CHUNK", "HAS_GRAMMAR", "BLOCK", "CBLOCK", "SMAX", "CLIMBS"}

    def sig(fn: Any) -> dict[str, str]:
        params = [a for a in fn.arg_names if a not in constexprs]
        return {a: "*" + types.get(a.removesuffix("_ptr"), "fp32") if a.endswith("_ptr") else "i32" for a in params}

    chunked = {"CHUNK": sampling.KERNEL_CHUNK, "HAS_GRAMMAR": True, "BLOCK": sampling.KERNEL_BLOCK}
    warps = sampling.KERNEL_WARPS
    final = {"SMAX": 64, "BLOCK": sampling.FINAL_BLOCK, "CBLOCK": sampling.CAND_BLOCK, "CLIMBS": sampling.CLIMBS}
    results = {
        "max": compile_sm90(
            sampling_triton.flare_sample_max, sig(sampling_triton.flare_sample_max), chunked, num_warps=warps
        ),
        "weights": compile_sm90(
            sampling_triton.flare_sample_weights,
            sig(sampling_triton.flare_sample_weights),
            {**chunked, "SMAX": 16},
            num_warps=warps,
        ),
        "narrow": compile_sm90(
            sampling_triton.flare_sample_narrow,
            sig(sampling_triton.flare_sample_narrow),
            {"CHUNK": sampling.KERNEL_CHUNK, "BLOCK": sampling.KERNEL_BLOCK},
            num_warps=warps,
        ),
        "final": compile_sm90(
            sampling_triton.flare_sample, sig(sampling_triton.flare_sample), final, num_warps=sampling.FINAL_WARPS
        ),
    }
    for name, res in results.items():
        assert res["stack"] == 0 and res["shared"] <= SM90_SHARED, (name, res)


def _gemv_kernel(dot: bool, **flags: Any) -> tuple[Any, dict[str, str], dict[str, Any]]:
    """One of `flare::gemv`'s kernels with its sm_90 signature and constants (bf16, norm
    prologue), `flags` over the defaults."""
    from ignition.capture import gemv_triton

    ptrs = {"X": "bf16", "W": "bf16", "B": "bf16", "NW": "bf16", "R": "bf16", "Y": "bf16", "P": "fp32"}
    ints = ["M", "N", "K", "stride_x", "stride_w", "stride_r", "stride_y"]
    sig = {**signature(ptrs, ints), "eps": "fp32"}
    base = {"BLOCK_K": 256, "NORM": 1, "GLU": False, "BIAS": False, "RESIDUAL": False, "PDL": 0, "SPLIT": 1}
    base |= {"PF_K": 0, "ESIZE": 2, "ADDR64": False}
    if dot:
        fn = gemv_triton.flare_gemv_dot
        consts = {"BLOCK_M": 16, "BLOCK_N": 64, **base, **flags}
    else:
        fn = gemv_triton.flare_gemv
        consts = {"ROWS": 1, "BLOCK_N": 16, "WIDE": False, **base, **flags}
    # The kernels' parameter order (`sig` gives types by name).
    order = [a for a in fn.arg_names if a not in consts]
    return fn, {a: sig[a] for a in order}, consts


@pytest.mark.parametrize("dot", [False, True])
def test_gemv_l2_prefetch_mode_compiles_for_sm90(dot: bool) -> None:
    """`flare::gemv`'s PDL mode 3 (`qualification/pdl_probe.py`): the bulk L2 prefetch before the
    grid-dependency wait assembles for sm_90 in both kernels, and its pointer tile adds no stack."""
    res = compile_sm90(*_gemv_kernel(dot, PDL=3, PF_K=2048, ESIZE=2), num_warps=4)
    assert res["stack"] == 0, res


@pytest.mark.parametrize("dot", [False, True])
def test_gemv_addr64_widens_the_weight_row_offsets(dot: bool) -> None:
    """`ADDR64` (a weight of 2**31 elements or more) offsets the weight by its tile's first row
    in int64 in both kernels (the lanes stay int32 within the tile), with no stack; without it
    the kernel computes no int64 product."""
    tile = {"BLOCK_N": 32 if dot else 16}  # tiles that spill in neither mode (64 x 256 dot does)
    ttir = {}
    for wide in (False, True):
        ttir[wide] = compile_kernel(*_gemv_kernel(dot, ADDR64=wide, **tile), num_warps=4).asm["ttir"]
    products = {w: len(re.findall(r"arith\.muli .*: i64\b", t)) for w, t in ttir.items()}
    assert products == {False: 0, True: 1}, products
    assert compile_sm90(*_gemv_kernel(dot, ADDR64=True, **tile), num_warps=4)["stack"] == 0
