"""The decode attention split's tuner (`ignition.capture.attention_tune`): what it times and what
it keeps, with the device timing replaced by a cost model (the timing itself runs on the GPU)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from ignition.capture import attention, attention_tune


@pytest.fixture
def timed(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, int, int]]]:
    """Records (rows, context, pps) of every timing; a step costs what `COST` says per layer."""
    calls: list[tuple[int, int, int]] = []

    def fake(heads: int, kv_heads: int, head_dim: int, page_tokens: int, table_pages: int, layers: int,
             rows: int, context: int, pps: int, rope: bool) -> tuple[float, torch.Tensor]:  # fmt: skip
        calls.append((rows, context, pps))
        # Serial pages per program plus a combine that widens with the groups; more rows make
        # groups queue (one page per program loses at four rows).
        groups = -(-table_pages // pps)
        pages = -(-context // page_tokens)
        us = min(pps, pages) * 0.6 + groups * 0.004 + (rows * groups * kv_heads / 400 if rows > 1 else 0)
        return us * layers / 1e3, torch.zeros(1)

    monkeypatch.setattr(attention_tune, "time_decode", fake)
    was = attention.PAGES_PER_SPLIT
    yield calls
    attention.PAGES_PER_SPLIT = was


def test_keeps_the_fastest_total_and_sets_it(timed: list[tuple[int, int, int]]) -> None:
    out = attention_tune.tune(9, 3, 64, 64, 72, 30, [1, 2, 4, 8, 16], rope=True)
    totals = {int(p): sum(t.values()) for p, t in out["us_per_layer"].items()}
    assert out["pages_per_split"] == min(totals, key=lambda p: totals[p])
    assert out["pages_per_split"] == attention.PAGES_PER_SPLIT
    assert out["splits"] == -(-72 // out["pages_per_split"])
    # Buckets past MAX_ROWS are not timed; layers are capped; every candidate at every point.
    assert {r for r, _, _ in timed} == {1, 2, 4}
    assert {c for _, c, _ in timed} == set(attention_tune.CONTEXTS)
    assert out["layers_timed"] == attention_tune.MAX_LAYERS
    assert len(timed) == 3 * len(attention_tune.CONTEXTS) * len(attention_tune.CANDIDATES)


def test_four_rows_can_outweigh_one(timed: list[tuple[int, int, int]]) -> None:
    """With 8 KV heads and wide tables, one page per program queues at four rows: the sum over
    the timed buckets keeps a wider group, one value for every bucket."""
    one = attention_tune.tune(32, 8, 64, 64, 128, 16, [1], rope=True)["pages_per_split"]
    both = attention_tune.tune(32, 8, 64, 64, 128, 16, [1, 4], rope=True)["pages_per_split"]
    assert one == 1
    assert both > 1


def test_short_limits_and_wide_tables(timed: list[tuple[int, int, int]]) -> None:
    # A 512-token limit: only the contexts within it, and no candidate over MAX_SPLITS.
    out = attention_tune.tune(8, 2, 256, 64, 8, 6, [4, 8], rope=False)
    assert {c for _, c, _ in timed} == {256}
    assert {r for r, _, _ in timed} == {4}
    timed.clear()
    # 192 tokens: the limit itself is the one context timed.
    attention_tune.tune(8, 2, 256, 64, 3, 6, [1], rope=False)
    assert {c for _, c, _ in timed} == {192}
    timed.clear()
    # 2,048 pages (131K tokens): candidates below 16 pages would exceed MAX_SPLITS groups.
    out = attention_tune.tune(8, 2, 256, 64, 2048, 6, [1], rope=False)
    assert out["pages_per_split"] == 16
    assert {p for _, _, p in timed} == {16}
    assert out["splits"] == attention_tune.MAX_SPLITS


@pytest.mark.parametrize("hybrid", [False, True])
def test_preparation_tunes_with_the_models_geometry(timed: list[tuple[int, int, int]], hybrid: bool) -> None:
    """`prepare._tune_attention` reads the geometry of either recipe's model (the hybrid's K/V
    layers are its attention layers only) and reports the choice with its time."""
    from types import SimpleNamespace

    from ignition import prepare
    from ignition.capture.hybrid import HybridGeometry, PagedQwen35
    from ignition.capture.paged import Geometry, PagedLlama

    dims: dict[str, Any] = {
        "layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "ffn": 128, "vocab": 256,
        "eps": 1e-6, "tie_embeddings": True, "attention_bias": False, "mlp_bias": False, "qk_norm": False,
        "eos_token_ids": (2,), "context_limit": 2048,
    }  # fmt: skip
    if hybrid:
        kinds = ("linear_attention", "linear_attention", "linear_attention", "full_attention")
        geo: Geometry = HybridGeometry(**dims, layer_kinds=kinds)
    else:
        geo = Geometry(**dims)
    model = SimpleNamespace(geo=geo, rope_in_attention=(PagedQwen35 if hybrid else PagedLlama).rope_in_attention)
    rec = SimpleNamespace(program=SimpleNamespace(model=model), timings={})
    out = prepare._tune_attention(rec, [1, 2, 4, 8])
    assert out["pages_per_split"] == attention.PAGES_PER_SPLIT
    assert out["layers_timed"] == (1 if hybrid else 4)
    assert {c for _, c, _ in timed} == {256, 1024}  # within the 2,048-token limit
    assert "attention_tune_s" in rec.timings


def test_a_candidate_that_fails_is_skipped(timed: list[tuple[int, int, int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A group size that cannot launch is reported and passed over; none launching is an error."""
    fake = attention_tune.time_decode

    def failing(*args: Any) -> tuple[float, torch.Tensor]:
        if args[8] == 1:
            raise RuntimeError("out of resources")
        return fake(*args)

    monkeypatch.setattr(attention_tune, "time_decode", failing)
    out = attention_tune.tune(9, 3, 64, 64, 72, 30, [1], rope=True)
    assert "1" in out["skipped"] and "1" not in out["us_per_layer"]
    assert out["pages_per_split"] != 1

    def broken(*args: Any) -> tuple[float, torch.Tensor]:
        raise RuntimeError("no device")

    monkeypatch.setattr(attention_tune, "time_decode", broken)
    with pytest.raises(RuntimeError, match="no pages-per-program candidate ran"):
        attention_tune.tune(9, 3, 64, 64, 72, 30, [1], rope=True)
