"""GPU machine: where one replay of a graph spends its time, kernel by kernel, from an exported
core and without torch. One decode step is replayed first (so the staging inputs are a real
request's), then every node of the graph is launched alone in dependency order with events
around each kernel; durations are grouped by kernel function.

    python3 qualification/kernel_breakdown.py CORE GRAPH OUT.json
"""

from __future__ import annotations

import ctypes as C
import json
import sys
from pathlib import Path
from typing import Any

from ignition.core.stepping import Row, Sampling, admit
from ignition.replay.core import CoreFiles, topological
from ignition.replay.cuda import LAUNCH_PARAM_BUFFER_POINTER, LAUNCH_PARAM_BUFFER_SIZE, LAUNCH_PARAM_END, DeviceCore
from ignition.replay.harness import CoreReplay

core = CoreFiles(Path(sys.argv[1]))
dev = DeviceCore(core)
rep = CoreReplay(core, dev)
g = next(x for x in core.graphs if x.name == sys.argv[2])
pages = rep.pages_for(0, 300)
first = admit(rep, 1, pages, list(range(10, 42)), 5, Sampling())
rep.rows_step(g, [Row(1, pages, 32, [first], (5, 1))])
lib, st = dev.lib, dev.stream
msg = g.message
ev = []
for i in topological(msg):
    n = msg.nodes[i]
    if n.WhichOneof("op") != "kernel":
        continue
    k = n.kernel
    params = C.create_string_buffer(core.kernel_params(n, dev.base), len(k.param_bytes))
    size = C.c_size_t(len(k.param_bytes))
    extra = (C.c_void_p * 5)(
        LAUNCH_PARAM_BUFFER_POINTER, C.addressof(params), LAUNCH_PARAM_BUFFER_SIZE, C.addressof(size), LAUNCH_PARAM_END
    )
    a, b = C.c_void_p(), C.c_void_p()
    dev.call("cuEventCreate", C.byref(a), C.c_uint(0))
    dev.call("cuEventCreate", C.byref(b), C.c_uint(0))
    dev.call("cuEventRecord", a, st)
    dev.call(
        "cuLaunchKernel",
        C.c_void_p(dev.functions[k.kernel_id]),
        C.c_uint(k.grid.x),
        C.c_uint(k.grid.y),
        C.c_uint(k.grid.z),
        C.c_uint(k.block.x),
        C.c_uint(k.block.y),
        C.c_uint(k.block.z),
        C.c_uint(k.dynamic_shared_memory),
        st,
        None,
        extra,
    )
    dev.call("cuEventRecord", b, st)
    ev.append((core.kernels[k.kernel_id].function_name, (k.grid.x, k.grid.y, k.grid.z), a, b, params, extra, size))
dev.synchronize()
by: dict[str, list[float]] = {}
total = 0.0
for name, _grid, a, b, *_ in ev:
    ms = C.c_float()
    dev.call("cuEventElapsedTime", C.byref(ms), a, b)
    by.setdefault(name, []).append(ms.value * 1e3)
    total += ms.value * 1e3
top = sorted(((sum(v), len(v), k) for k, v in by.items()), reverse=True)
out: dict[str, Any] = {
    "graph": g.name,
    "kernels": len(ev),
    "sum_of_kernel_us": round(total, 1),
    "by_function": [{"function": k, "count": c, "us": round(t, 1), "share": round(t / total, 3)} for t, c, k in top],
}
Path(sys.argv[3]).write_text(json.dumps(out, indent=1) + "\n")
print(json.dumps({**out, "by_function": out["by_function"][:14]}, indent=1))
dev.close()
