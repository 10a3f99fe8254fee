"""The tiny Llama's decode and speculative programs with the few-row kernels the device runs
(`flare::gemv`, `flare::rms_norm`, `flare::sample`) under Triton's CPU interpreter, eager:
speculative generation equals ordinary generation (sampled with penalties and filters, and
greedy), and both equal generation through the torch sampler and norms. Prints one JSON line;
exit 1 on a mismatch. Needs TRITON_INTERPRET=1 before Triton is imported."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from ignition.capture.gemv import Projections
from ignition.capture.runner import GraphRunner, Sampling
from ignition.capture.sampling import Sampler
from ignition.core.stepping import replaying
from tests.ignition.test_paged_cpu import TINY, _checkpoint
from tests.ignition.test_speculative_cpu import _eager, _params, _program

tmp = Path(tempfile.mkdtemp(prefix="speculative-kernels-"))
_checkpoint(tmp, TINY)
prog = _program(tmp, [(1, 3), (4, 3)])
prog.model.proj = Projections(kernel=True)
prog.model.gemv = True  # as on the device: decode rows unpadded, few-row projections through the kernel
prog.model.sampler = Sampler(kernel=True)
_eager(prog)
ref = _program(tmp, [(1, 3), (4, 3)])
_eager(ref)
runner, torch_runner = GraphRunner(prog), GraphRunner(ref)
prompt = list(range(3, 60))
out = {}
ok = True
for name, params in (("sampled", _params()), ("greedy", Sampling(top_k=1))):
    want = runner.generate(prompt, 21, params, 7)
    got, rounds = runner.generate_speculative(prompt, 21, params, 7, replaying(want))
    torch_tokens = torch_runner.generate(prompt, 21, params, 7)
    out[name] = {"speculative_equal": got == want, "rounds": rounds, "torch_equal": want == torch_tokens}
    ok &= got == want and want == torch_tokens and rounds == 2
print(json.dumps(out))
sys.exit(0 if ok else 1)
