"""GPU machine: the Rust fresh-process replay of every graph prepare dumped (CORE.work/io),
compared bitwise with torch's outputs; decode_b1 also relocated.

    python3 qualification/rust_replay_io.py CORE CORE_REPLAY_BIN OUT.json
"""

import json
import sys
from pathlib import Path

from ignition.capture.rust_replay import replay_in_rust

core, binary, report = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
work = core.parent / (core.name + ".work")
out = {}
for gdir in sorted((work / "io").iterdir()):
    for reloc in (False, True) if gdir.name == "decode_b1" else (False,):
        r = replay_in_rust(binary, core, work / "io", work, gdir.name, 20, reloc)
        r.pop("stderr", None)
        out[gdir.name + (" relocated" if reloc else "")] = r
        print(gdir.name, reloc, r.get("bitwise_equal"), r.get("wall_s"), flush=True)
report.write_text(json.dumps(out, indent=1))
