"""The runtime-core schema loaded from the .proto, and the typed manifest's enums."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ignition.core.manifest import PROTO_ENUMS, EdgeDependency
from ignition.core.schema import SchemaError, load_schema, parse_proto


def test_python_enums_match_the_proto() -> None:
    schema = load_schema()
    for py_enum, proto_name in PROTO_ENUMS.items():
        values = schema.enum_values(proto_name)
        prefix = "".join("_" + c if c.isupper() else c.upper() for c in proto_name).lstrip("_")
        proto = {name.removeprefix(prefix + "_"): n for name, n in values.items() if n != 0}
        # Value 0 is the proto's UNSPECIFIED; `EdgeDependency` alone names what it means there
        # (FULL: an edge without a dependency kind is a full dependency).
        ours = {m.name: int(m) for m in py_enum if int(m) != 0 or py_enum is not EdgeDependency}
        if py_enum is EdgeDependency:
            assert int(EdgeDependency.FULL) == values.get("EDGE_DEPENDENCY_UNSPECIFIED") == 0
        assert ours == proto, proto_name
    assert set(PROTO_ENUMS.values()) == set(schema.enum_names())


def test_messages_round_trip() -> None:
    schema = load_schema()
    core = schema.message("RuntimeCore")()
    core.identity.abi_version = 2
    b = core.buffers.add(id=7, name="w", role=1, dtype=15)
    b.zero_fill.SetInParent()
    p = core.frontend.sampling.temperature
    p.default = 0.5
    decoded = schema.message("RuntimeCore").FromString(core.SerializeToString())
    assert decoded.buffers[0].WhichOneof("payload") == "zero_fill"
    assert decoded.frontend.sampling.temperature.default == 0.5
    assert not decoded.frontend.sampling.temperature.HasField("range")  # proto3 optional presence


@pytest.mark.parametrize(
    "source",
    [
        'syntax = "proto2"; message A { optional int32 x = 1; }',
        'syntax = "proto3"; message A { map<string, int32> m = 1; }',
        'syntax = "proto3"; message A { int32 x = 1 [deprecated = true]; }',
        'syntax = "proto3"; message A { Missing x = 1; }',
        'syntax = "proto3"; import "other.proto";',
    ],
)
def test_unsupported_syntax_is_rejected(source: str) -> None:
    with pytest.raises(SchemaError):
        parse_proto(source)


def test_matches_protoc_when_available(tmp_path: Path) -> None:
    """Byte-equal to protoc's descriptor (json_name aside). Needs grpcio-tools; not in CI."""
    pytest.importorskip("grpc_tools")
    from google.protobuf import descriptor_pb2

    from ignition.core.schema import proto_path

    out = tmp_path / "d.pb"
    root = proto_path().parents[3]
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{root}", f"--descriptor_set_out={out}", str(proto_path())],
        check=True,
    )
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    ref = fds.file[0]
    for m in ref.message_type:
        for f in m.field:
            f.ClearField("json_name")
    assert ref == load_schema().file_proto
