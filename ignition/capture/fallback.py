"""Every `flare::` op gets its Inductor lowering where the op is defined, not on first lowering.

Why: on its implicit-fallback path, Inductor formats each argument's IR into an info-log line
before the logger's level is checked (`exc.OperatorIssue.operator_str`). An argument behind a long
chain of unrealized views and pointwise nodes prints as a string that grows much faster than the
chain: on the device (2026-12-05, torch 2.11) the first graph of a Qwen3.5 core and of a SmolLM2
core each spent 8 minutes in `ir.__str__` under `operator_str` without finishing. Registering the
lowering first skips that path. The lowering is the one the implicit path would register: a
fallback kernel with the layout constraint the op's tags imply (Inductor's allow-list path would
drop that constraint). For any other op Inductor lowers implicitly (an ATen op without a lowering),
`bound_operator_str` keeps the formatting short and `watch_lowerings` names the op."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from torch._library.custom_ops import CustomOpDef

    Op = TypeVar("Op", bound=CustomOpDef)


def declare(op: Op) -> Op:
    """Register `op`'s fallback lowering (idempotent) and return `op`. Costs a dictionary insert;
    the first call in a process imports Inductor's lowering table."""
    from torch._inductor import lowering
    from torch._library.utils import get_layout_constraint_tag

    overload = op._opoverload
    if overload not in lowering.lowerings:
        tag = get_layout_constraint_tag(overload, with_default=True)
        lowering.make_fallback(overload, layout_constraint=lowering.tag_to_layout_constraint(tag), warn=False)
    return op


def undeclared(namespace: str = "flare") -> list[str]:
    """The overloads registered under `namespace` that have no Inductor lowering (for tests)."""
    import torch
    from torch._inductor import lowering

    out = []
    for name in torch._C._dispatch_get_all_op_names():
        ns, _, rest = name.partition("::")
        if ns != namespace:
            continue
        op_name, _, overload = rest.partition(".")
        packet = getattr(getattr(torch.ops, ns), op_name)
        if getattr(packet, overload or "default") not in lowering.lowerings:
            out.append(name)
    return sorted(out)


@contextmanager
def watch_lowerings() -> Iterator[list[str]]:
    """Yields a list that, on exit, names the ops whose lowering was registered inside the block:
    ops Inductor lowered implicitly (any that still lack a declared lowering)."""
    from torch._inductor import lowering

    before = set(lowering.lowerings)
    found: list[str] = []
    try:
        yield found
    finally:
        found.extend(sorted(str(k) for k in lowering.lowerings if k not in before))


def _brief(arg: Any, depth: int = 0) -> str:
    if arg is None or isinstance(arg, (bool, int, float, str)):
        return repr(arg)[:80]
    if isinstance(arg, (list, tuple)) and depth < 2:
        inner = ", ".join(_brief(a, depth + 1) for a in arg[:8])
        return f"[{inner}{', ...' if len(arg) > 8 else ''}]"
    size = getattr(arg, "get_size", None)
    if callable(size):
        try:
            return f"{type(arg).__name__}{tuple(size())}"
        except Exception:  # some IR nodes have no size; the name is enough for a log line
            pass
    return type(arg).__name__


def _operator_str(target: object, args: Sequence[object], kwargs: Mapping[str, object]) -> str:
    lines = [f"target: {target}"] + [f"args[{i}]: {_brief(a)}" for i, a in enumerate(args)]
    lines += [f"kwargs[{k}]: {_brief(v)}" for k, v in kwargs.items()]
    return "\n".join("  " + line for line in lines)


def bound_operator_str() -> None:
    """Make Inductor describe an implicitly lowered op by its name and its arguments' types and
    sizes, never their IR (idempotent). The description only feeds a log line and error
    messages; the lowering is unchanged. Needed where that log line is formatted eagerly
    (torch 2.11; 2.15 formats it only when the level is enabled)."""
    from torch._inductor import exc

    exc.OperatorIssue.operator_str = staticmethod(_operator_str)  # type: ignore[method-assign]
