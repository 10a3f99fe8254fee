"""`python -m ignition`: preparation commands.

The runtime-core format these commands write is defined in proto/flare/core/v1 and validated by
the Rust loader (`flare check CORE`). Model preparation itself is not implemented yet; each
command says so and exits with status 2 rather than producing a partial core.
"""

from __future__ import annotations

import argparse
import sys

NOT_YET = (
    "ignition {command}: not implemented in this build. "
    "The runtime-core contract exists (proto/, `flare check`); model preparation is pending."
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ignition", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("fetch-default", help="convert the embedded default model (SmolLM2-135M-Instruct)")
    fetch.add_argument("--out", required=True)
    prepare = sub.add_parser("prepare", help="prepare a checkpoint and export a runtime core")
    prepare.add_argument("--model", required=True)
    prepare.add_argument("--out", required=True)
    prepare.add_argument("--decode-buckets", default="1,2,4,8")
    prepare.add_argument("--prefill-chunk-size", type=int)
    prepare.add_argument("--context-limit", type=int)
    prepare.add_argument("--no-compile", action="store_true")
    replay = sub.add_parser("replay", help="minimal Python replay of a core's graphs")
    replay.add_argument("core")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    print(NOT_YET.format(command=args.command), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
