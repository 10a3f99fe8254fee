import json, sys
from pathlib import Path
from ignition.capture.rust_replay import replay_in_rust
work = Path("/tmp/smolcore.work"); out = {}
for gdir in sorted((work / "io").iterdir()):
    for reloc in (False, True) if gdir.name == "decode_b1" else (False,):
        r = replay_in_rust(Path("/tmp/core_replay"), Path("/tmp/smolcore"), work / "io", work, gdir.name, 20, reloc)
        r.pop("stderr", None)
        out[gdir.name + (" relocated" if reloc else "")] = r
        print(gdir.name, reloc, r.get("bitwise_equal"), r.get("wall_s"), flush=True)
Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
