"""The PreparedContract's view shapes, mirrored from crates/helios-contract/src/prepared.rs.

For each value kind: the dtypes, row-major shape and direction its byte view must have in a
graph of a given kind and capacity, and which values each graph kind must bind.
"""

from __future__ import annotations

from dataclasses import dataclass

from ignition.core.manifest import (
    CacheScheme,
    Capacities,
    Direction,
    Dtype,
    GraphCapacity,
    GraphKind,
    MaintenanceOp,
    ValueKind,
)

V = ValueKind


@dataclass(frozen=True)
class ExpectedView:
    dtypes: tuple[Dtype, ...]
    # None: a dimension the contract leaves to the recipe.
    shape: tuple[int | None, ...]
    direction: Direction

    def matches(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == len(self.shape) and all(
            w is None or w == g for w, g in zip(self.shape, shape, strict=True)
        )


_PER_REQUEST_I32 = {
    V.REQUEST_SLOTS,
    V.QUERY_LENGTHS,
    V.CONTEXT_LENGTHS,
    V.STATE_ROW_INDICES,
    V.SOURCE_ROWS,
    V.DESTINATION_ROWS,
    V.EXPECTED_CONSUMED,
    V.CHECKPOINT_EPOCH,
    V.TOP_K,
}
_PER_REQUEST_F32 = {
    V.TEMPERATURE,
    V.TOP_P,
    V.MIN_P,
    V.REPETITION_PENALTY,
    V.PRESENCE_PENALTY,
    V.FREQUENCY_PENALTY,
}


# Persistent request state a graph kind binds, and how: sampling graphs store every sampled
# token; decode and speculative programs read it (a negative packed token id takes the row's
# pending token).
_PENDING_DIRECTION = {
    GraphKind.DECODE: Direction.STATE_READ_WRITE,
    GraphKind.SPECULATIVE: Direction.STATE_READ_WRITE,
    GraphKind.PREFILL: Direction.STATE_WRITE,
    GraphKind.RESUME_SAMPLING: Direction.STATE_WRITE,
}


def expected_view(
    value: ValueKind,
    kind: GraphKind,
    capacity: GraphCapacity,
    completion_token_capacity: int,
    scheme: CacheScheme,
    caps: Capacities,
) -> ExpectedView | None:
    """None: a graph of this kind may not bind `value`."""
    b, t = capacity.request_count, capacity.token_capacity
    inp = Direction.INPUT
    if value is V.PENDING_TOKENS:
        direction = _PENDING_DIRECTION.get(kind)
        return None if direction is None else ExpectedView((Dtype.I32,), (caps.request_slots + 1,), direction)
    if value is V.TOKEN_IDS:
        return ExpectedView((Dtype.I32,), (t,), inp)
    if value is V.POSITIONS:
        return ExpectedView((Dtype.I32, Dtype.I64), (t,), inp)
    if value is V.SLOT_MAPPING:
        return ExpectedView((Dtype.I64,), (t,), inp)
    if value is V.PAGE_TABLE:
        return ExpectedView((Dtype.I32,), (b, caps.pages_per_request(scheme.page_tokens)), inp)
    if value in _PER_REQUEST_I32:
        return ExpectedView((Dtype.I32,), (b,), inp)
    if value in _PER_REQUEST_F32:
        return ExpectedView((Dtype.F32,), (b,), inp)
    if value in (V.RNG_SEED, V.RNG_COUNTER):
        return ExpectedView((Dtype.U64, Dtype.I64), (b,), inp)
    if value is V.SAMPLE_FLAGS:
        return ExpectedView((Dtype.U32,), (b,), inp)
    if value is V.GRAMMAR_MASK:
        # A speculative program masks each lane (the grammar state at its position).
        rows = t if kind is GraphKind.SPECULATIVE else b
        return ExpectedView((Dtype.U32,), (rows, -(-caps.vocab_size // 32)), inp)
    if value is V.COMPLETION_RECORDS:
        words = caps.completion_record_header_words + completion_token_capacity
        return ExpectedView((Dtype.U32,), (b, words), Direction.OUTPUT)
    if value is V.PATCH_PIXELS:
        return ExpectedView((Dtype.BF16, Dtype.F16, Dtype.F32), (capacity.patch_capacity, None), inp)
    return ExpectedView((Dtype.I32,), (None,), inp)  # IMAGE_FEATURE_OFFSETS


def required_values(kind: GraphKind, op: MaintenanceOp | None) -> tuple[ValueKind, ...]:
    if kind is GraphKind.PREFILL:
        return (
            V.TOKEN_IDS,
            V.POSITIONS,
            V.SLOT_MAPPING,
            V.PAGE_TABLE,
            V.REQUEST_SLOTS,
            V.QUERY_LENGTHS,
            V.COMPLETION_RECORDS,
        )
    if kind is GraphKind.DECODE:
        return (V.REQUEST_SLOTS, V.PAGE_TABLE, V.COMPLETION_RECORDS)
    if kind is GraphKind.SPECULATIVE:
        return (V.TOKEN_IDS, V.POSITIONS, V.QUERY_LENGTHS, V.REQUEST_SLOTS, V.PAGE_TABLE, V.COMPLETION_RECORDS)
    if kind is GraphKind.RESUME_SAMPLING:
        return (V.REQUEST_SLOTS, V.STATE_ROW_INDICES, V.COMPLETION_RECORDS)
    if kind is GraphKind.STATE_MAINTENANCE:
        if op in (MaintenanceOp.RESTORE, MaintenanceOp.SNAPSHOT):
            return (V.SOURCE_ROWS, V.DESTINATION_ROWS, V.EXPECTED_CONSUMED)
        if op in (MaintenanceOp.INITIALIZE, MaintenanceOp.RESET):
            return (V.DESTINATION_ROWS,)
        if op is MaintenanceOp.ADMIT_HISTOGRAM:
            return (V.REQUEST_SLOTS, V.TOKEN_IDS)
        return ()
    if kind is GraphKind.VISION:
        return (V.PATCH_PIXELS,)
    return ()
