"""`gemv.precompile` end to end on CPU: the specializations the tuner would launch, grouped as
Triton keys them, launched in a spawned pool (Triton's interpreter stands in for the compiler);
then `precompile_groups` for tiles registered as `tune` would. Prints one JSON line. Needs
TRITON_INTERPRET=1 in the environment before Triton is imported."""

from __future__ import annotations

import json

import torch

from ignition.capture.gemv import (
    GemvConfig,
    Problem,
    Variant,
    compile_tasks,
    group_compile_tasks,
    precompile,
    precompile_groups,
    set_config,
)


def main() -> None:
    gen = torch.Generator().manual_seed(0)

    def problem(name: str, n: int, k: int, variant: Variant) -> Problem:
        norms = [torch.randn(k, generator=gen)] if variant.norm else None
        return Problem(name, [torch.randn(n, k, generator=gen)], variant, norms=norms)

    cands = (GemvConfig(8, 64, 4), GemvConfig(16, 64, 2, wide=True), GemvConfig(8, 32, 4, split=2))
    res = Variant(residual=True)
    # 32x64 and 48x64 are alike to Triton (multiples of 16) except for the split's reduction
    # block; 37x300 is not; the norm variant is its own kernel.
    problems = [problem("a", 32, 64, res), problem("b", 48, 64, res), problem("c", 37, 300, res)]
    problems.append(problem("d", 32, 128, Variant(norm=True)))
    tasks = compile_tasks(problems, [1, 3], cands)
    per_problem = {p.name: sum((t.n, t.k) == tuple(p.weights[0].shape) for t in tasks) for p in problems}
    report = precompile(problems, [1, 3], cands, workers=2)
    # The tiles `tune` would register. "e" is "a" at another multiple of 16 with a's tile (no
    # task of its own); "f" has a tensor-core tile (no group size to choose).
    more = [problem("e", 64, 64, res), problem("f", 32, 64, Variant())]
    for p, cfg in zip(problems + more, (*cands, cands[0], cands[0], GemvConfig(16, 64, 4, dot=True)), strict=True):
        n, k = p.weights[0].shape
        set_config(n, k, p.variant, cfg)
    groups = [(t.n, t.k, t.m, t.group_rows) for t in group_compile_tasks(problems + more, [1, 3, 4, 16])]
    report_groups = precompile_groups(problems + more, [1, 3, 4, 16], workers=2)
    out = {"tasks": len(tasks), "per_problem": per_problem, "precompile": report}
    print(json.dumps(out | {"group_tasks": groups, "precompile_groups": report_groups}))


if __name__ == "__main__":  # the pool's spawned workers import this module
    main()
