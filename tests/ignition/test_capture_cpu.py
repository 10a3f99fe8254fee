"""CPU checks of the GPU capture path (ignition/capture): what runs without a device.

The capture itself (arena, torch.compile, CUDA graph walk, Rust replay) is qualified on the GPU
machine: qualification/ignition_capture_replay.json.
"""

from __future__ import annotations

import importlib

import pytest

from tests.ignition.conftest import require_torch


def test_gaps_cover_blocks_outside_named_tensors() -> None:
    from ignition.capture.recorder import _align_of, _gaps

    # A 4 KiB block holding one 100-byte tensor at 1024: fillers before it and after its
    # 512-rounded end, never sharing a word with it.
    assert _gaps(0, 4096, [(1024, 1124)]) == [(0, 1024), (1536, 4096)]
    assert _gaps(0, 4096, []) == [(0, 4096)]
    assert _gaps(0, 512, [(0, 512)]) == []
    assert _align_of(0) == 4096 and _align_of(1536) == 512 and _align_of(1 << 20) == 4096


def test_allocator_source_exports_the_pluggable_entry_points() -> None:
    from ignition.capture.arena import SOURCE

    text = SOURCE.read_text()
    for symbol in ("flare_arena_init", "flare_arena_alloc", "flare_arena_free", "cuMemAddressReserve",
                   "cuMemCreate", "cuMemMap", "cuMemSetAccess"):  # fmt: skip
        assert symbol in text


def test_modules_import_without_a_device() -> None:
    require_torch()
    for m in ("ignition.capture.driver", "ignition.capture.arena", "ignition.capture.recorder"):
        importlib.import_module(m)


def test_tiny_model_decode_and_prefill_agree_on_cpu() -> None:
    torch = require_torch()
    from ignition.capture.model import RECORD_MAGIC, TinyConfig, TinyLlama

    c = TinyConfig(vocab=256)
    m = TinyLlama(c)
    gen = torch.Generator().manual_seed(0)
    kv = (torch.randn(c.kv_shape(), generator=gen) * 0.5).to(torch.bfloat16)
    pages = torch.randperm(c.max_kv_pages, generator=gen).view(c.request_slots, c.pages_per_request).int()
    # Prefill one token at position 70 of request 1, and decode the same token there: same KV
    # write, same logits row, same record token.
    pos, tok = torch.tensor([70]).int(), torch.tensor([7]).int()
    slot = pages[1].long()[pos.long() // c.page_tokens] * c.page_tokens + pos.long() % c.page_tokens
    kv_p, rec_p = kv.clone(), torch.zeros(1, 9, dtype=torch.int32)
    logits_p = m.prefill(tok, pos, slot, pages[1:2], torch.tensor([1]).int(), torch.tensor([1]).int(), kv_p, rec_p)
    kv_d, rec_d = kv.clone(), torch.zeros(1, 9, dtype=torch.int32)
    logits_d = m.decode(tok, pos, torch.tensor([1]).int(), pages[1:2], kv_d, rec_d)
    assert torch.equal(logits_p, logits_d) and torch.equal(kv_p, kv_d) and torch.equal(rec_p, rec_d)
    assert rec_d[0, 0].item() == RECORD_MAGIC and rec_d[0, 1].item() == 1 and rec_d[0, 4].item() == 71
    assert not torch.equal(kv_d, kv)  # the KV slot was written
    # A negative slot writes nothing.
    kv_n = kv.clone()
    m.prefill(tok, pos, torch.tensor([-1]), pages[1:2], torch.tensor([1]).int(), torch.tensor([1]).int(), kv_n,
              torch.zeros(1, 9, dtype=torch.int32))  # fmt: skip
    assert torch.equal(kv_n, kv)


@pytest.mark.parametrize("name", ["decode", "prefill"])
def test_model_methods_exist(name: str) -> None:
    require_torch()
    from ignition.capture.model import TinyLlama

    assert callable(getattr(TinyLlama, name))
