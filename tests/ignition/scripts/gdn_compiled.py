"""`flare::gdn_conv`, `flare::gdn_delta` and `flare::store_row` inside a torch.compile'd layer
loop on CPU (Triton's interpreter runs the kernels, float32), the way the hybrid forward calls
them: state regions of a byte buffer of continuation rows, updated in place by the ops while the
compiled step also mutates other state (a histogram, as sampling does). Checks the rows against
the eager references (every region, every row), the outputs, that the ops are called, and that
the compiled code allocates no rows-sized buffer (the rows are never functionalized or copied).
Prints one JSON line; exit 1 on a mismatch. Needs TRITON_INTERPRET=1 before Triton is imported."""

from __future__ import annotations

import json
import re
import sys

import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

from ignition.capture import gdn

conv_op, delta_op, store_op = gdn.gdn_ops()
gen = torch.Generator().manual_seed(0)
layers, R, K = 2, 5, 4
hk, hv, dk, dv, hidden = 2, 4, 8, 8, 32
kd = hk * dk
C = 2 * kd + hv * dv  # query, key and value channels
conv_bytes, state_bytes = C * (K - 1) * 4, hv * dk * dv * 4  # float32 history here
offsets = [(i * (conv_bytes + state_bytes), i * (conv_bytes + state_bytes) + conv_bytes) for i in range(layers)]
hidden_at = layers * (conv_bytes + state_bytes)
stamp_at = hidden_at + hidden * 4  # the row's stamp: consumed count (written here), epoch
row_bytes = stamp_at + 8
w_in = [torch.randn(C + 2 * hv, hidden, generator=gen) * 0.2 for _ in range(layers)]
w_conv = [torch.randn(C, K, generator=gen) for _ in range(layers)]
w_out = [torch.randn(hidden, hv * dv, generator=gen) * 0.2 for _ in range(layers)]


def region(rows: torch.Tensor, at: int, nbytes: int, shape: tuple[int, ...]) -> torch.Tensor:
    return rows[:, at : at + nbytes].view(torch.float32).view(rows.shape[0], *shape)


def split(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t = y.shape[0]
    return y[:, :kd].view(t, hk, dk), y[:, kd : 2 * kd].view(t, hk, dk), y[:, 2 * kd :].view(t, hv, dv)


consumed = torch.tensor([5, 0, 9], dtype=torch.int32)


def step(x: torch.Tensor, rows: torch.Tensor, live: torch.Tensor, hist: torch.Tensor, ops: bool) -> torch.Tensor:
    """One decode step over lanes `live` (negative: padding); `hist` counts something per lane."""
    for i in range(layers):
        proj = F.linear(x, w_in[i])
        mixed, b, a = proj[:, :C], proj[:, C : C + hv], proj[:, C + hv :]
        beta, g = torch.sigmoid(b), -F.softplus(a)
        if ops:
            y = conv_op(mixed, w_conv[i], rows, live.int(), None, offsets[i][0], K)
            q, k, v = split(y)
            o = delta_op(q, k, v, g.contiguous(), beta.contiguous(), rows, live.int(), None, offsets[i][1])
        else:
            h_view = region(rows, offsets[i][0], conv_bytes, (C, K - 1))
            s_view = region(rows, offsets[i][1], state_bytes, (hv, dk, dv))
            outs = []
            for lane in range(x.shape[0]):
                r = int(live[lane])
                yy, nh = gdn.conv_reference(mixed[lane : lane + 1], h_view[max(r, 0)], w_conv[i])
                q, k, v = split(yy)
                oo, ns = gdn.delta_rule_reference(s_view[max(r, 0)], q, k, v, g[lane : lane + 1], beta[lane : lane + 1])
                if r >= 0:
                    h_view[r], s_view[r] = nh, ns
                outs.append(oo)
            o = torch.cat(outs)
        x = x + F.linear(o.reshape(x.shape[0], -1), w_out[i])
    hist.index_put_((torch.where(live >= 0, live, 0),), (live >= 0).int(), accumulate=True)
    if ops:
        stored: torch.Tensor = store_op(x, rows, live.int(), hidden_at, consumed, stamp_at)
        return stored
    out_view = region(rows, hidden_at, hidden * 4, (hidden,))
    stamps = rows[:, stamp_at : stamp_at + 8].view(torch.int32)
    for lane in range(x.shape[0]):
        if int(live[lane]) >= 0:
            out_view[int(live[lane])] = x[lane]
            stamps[int(live[lane]), 0] = consumed[lane]
    return x


x = torch.randn(3, hidden, generator=gen)
live = torch.tensor([3, -1, 1])
rows0 = torch.zeros(R, row_bytes, dtype=torch.uint8)
rows0.view(torch.float32)[1:].copy_(torch.randn(R - 1, row_bytes // 4, generator=gen) * 0.1)
ref_rows, rows = rows0.clone(), rows0.clone()
ref_hist, hist = torch.zeros(R, dtype=torch.int32), torch.zeros(R, dtype=torch.int32)
ref = step(x, ref_rows, live, ref_hist, False)
compiled = torch.compile(lambda a, r, lv, hs: step(a, r, lv, hs, True), fullgraph=True, dynamic=False)
out, codes = run_and_get_code(compiled, x, rows, live, hist)
code = "\n".join(codes)
shapes = [
    tuple(int(v) for v in m.split(",") if v.strip()) for m in re.findall(r"empty_strided\w*\(\(([\d, ]+)\)", code)
]
as_f32 = rows.view(torch.float32)
report = {
    "rows_max_abs_err": float((as_f32 - ref_rows.view(torch.float32)).abs().max()),
    "untouched_rows_bitwise": bool(torch.equal(rows[[0, 2, 4]], rows0[[0, 2, 4]])),
    "stamps_equal": bool(torch.equal(rows[:, stamp_at:], ref_rows[:, stamp_at:])),
    "out_max_abs_err": float((out - ref).abs().max()),
    "hist_equal": bool(torch.equal(hist, ref_hist)),
    "op_calls": sum(code.count(f"flare.{n}.default(") for n in ("gdn_conv", "gdn_delta", "store_row")),
    "rows_sized_buffers": sum(s == (R, row_bytes) for s in shapes),
}
print(json.dumps(report))
ok = (
    report["rows_max_abs_err"] < 1e-4
    and report["untouched_rows_bitwise"]
    and report["out_max_abs_err"] < 1e-4
    and report["hist_equal"]
    and report["stamps_equal"]
    and report["op_calls"] == 2 * layers + 1
    and report["rows_sized_buffers"] == 0
)
sys.exit(0 if ok else 1)
