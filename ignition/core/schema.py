"""Protobuf classes for proto/flare/core/v1/runtime_core.proto, built at import time.

No protoc and no generated `_pb2.py`: the .proto file (the single source of truth, shared with
the Rust crate's prost build) is parsed here into a `FileDescriptorProto`, added to a private
descriptor pool and turned into message classes with `message_factory`. The parser accepts the
proto3 subset the project uses (messages, enums, scalar/message/enum fields, `repeated`,
`optional`, `oneof`, `reserved`, comments) and rejects anything else with `SchemaError`, so a
new construct in the .proto fails loudly here instead of being mis-encoded.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PROTO_RELATIVE = "flare/core/v1/runtime_core.proto"
ROOT_MESSAGE = "RuntimeCore"

_F = descriptor_pb2.FieldDescriptorProto
_SCALARS: dict[str, descriptor_pb2.FieldDescriptorProto.Type.ValueType] = {
    "double": _F.TYPE_DOUBLE,
    "float": _F.TYPE_FLOAT,
    "int64": _F.TYPE_INT64,
    "uint64": _F.TYPE_UINT64,
    "int32": _F.TYPE_INT32,
    "uint32": _F.TYPE_UINT32,
    "fixed64": _F.TYPE_FIXED64,
    "fixed32": _F.TYPE_FIXED32,
    "bool": _F.TYPE_BOOL,
    "string": _F.TYPE_STRING,
    "bytes": _F.TYPE_BYTES,
    "sfixed32": _F.TYPE_SFIXED32,
    "sfixed64": _F.TYPE_SFIXED64,
    "sint32": _F.TYPE_SINT32,
    "sint64": _F.TYPE_SINT64,
}


@dataclass(eq=False)
class SchemaError(Exception):
    """The .proto file uses syntax this loader does not understand, or is malformed."""

    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


def proto_path() -> Path:
    """Location of runtime_core.proto: $FLARE_PROTO_DIR, else the repository's proto/ folder."""
    base = os.environ.get("FLARE_PROTO_DIR")
    root = Path(base) if base else Path(__file__).resolve().parents[2] / "proto"
    return root / PROTO_RELATIVE


_TOKEN = re.compile(r'\s*(?:(//[^\n]*)|(/\*.*?\*/)|("(?:[^"\\]|\\.)*")|(-?\d+)|([A-Za-z_][\w.]*)|(\S))', re.S)


class _Tokens:
    def __init__(self, text: str, path: str) -> None:
        self.path = path
        self.items: list[tuple[str, int]] = []
        pos = 0
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if m is None:
                break
            line = text.count("\n", 0, m.start(0) + len(m.group(0)) - len(m.group(0).lstrip())) + 1
            pos = m.end()
            if m.group(1) or m.group(2):
                continue
            tok = m.group(3) or m.group(4) or m.group(5) or m.group(6)
            if tok:
                self.items.append((tok, line))
        self.i = 0

    def peek(self) -> str | None:
        return self.items[self.i][0] if self.i < len(self.items) else None

    def line(self) -> int:
        return self.items[min(self.i, len(self.items) - 1)][1] if self.items else 0

    def next(self) -> str:
        if self.i >= len(self.items):
            raise SchemaError(self.path, self.line(), "unexpected end of file")
        tok = self.items[self.i][0]
        self.i += 1
        return tok

    def expect(self, want: str) -> None:
        line = self.line()
        got = self.next()
        if got != want:
            raise SchemaError(self.path, line, f"expected {want!r}, found {got!r}")

    def error(self, message: str) -> SchemaError:
        return SchemaError(self.path, self.line(), message)


@dataclass
class _PendingField:
    proto: descriptor_pb2.FieldDescriptorProto
    type_name: str | None
    scope: str


def _skip_statement(t: _Tokens) -> None:
    while t.next() != ";":
        pass


def _parse_field(
    t: _Tokens,
    label_word: str | None,
    scope: str,
    pending: list[_PendingField],
    field: descriptor_pb2.FieldDescriptorProto,
) -> descriptor_pb2.FieldDescriptorProto:
    """Fills `field` (already added to its message: protobuf containers copy on append)."""
    type_word = t.next()
    if type_word == "map" or t.peek() == "<":
        raise t.error("map fields are not supported by this loader")
    field.name = t.next()
    t.expect("=")
    number = t.next()
    if not number.isdigit():
        raise t.error(f"field {field.name}: bad number {number!r}")
    field.number = int(number)
    if t.peek() == "[":
        raise t.error(f"field {field.name}: field options are not supported by this loader")
    t.expect(";")
    field.label = _F.LABEL_REPEATED if label_word == "repeated" else _F.LABEL_OPTIONAL
    if type_word in _SCALARS:
        field.type = _SCALARS[type_word]
        pending.append(_PendingField(field, None, scope))
    else:
        pending.append(_PendingField(field, type_word, scope))
    return field


def _parse_enum(t: _Tokens, name: str) -> descriptor_pb2.EnumDescriptorProto:
    enum = descriptor_pb2.EnumDescriptorProto(name=name)
    t.expect("{")
    while (tok := t.next()) != "}":
        if tok in ("reserved", "option"):
            _skip_statement(t)
            continue
        t.expect("=")
        value = t.next()
        t.expect(";")
        enum.value.add(name=tok, number=int(value))
    if not enum.value or enum.value[0].number != 0:
        raise t.error(f"enum {name}: the first value must be 0")
    return enum


def _parse_message(
    t: _Tokens,
    name: str,
    scope: str,
    pending: list[_PendingField],
    names: dict[str, str],
    msg: descriptor_pb2.DescriptorProto,
) -> descriptor_pb2.DescriptorProto:
    msg.name = name
    full = f"{scope}.{name}"
    names[full] = "message"
    synthetic: list[descriptor_pb2.FieldDescriptorProto] = []
    t.expect("{")
    while (tok := t.next()) != "}":
        if tok in ("reserved", "option"):
            _skip_statement(t)
        elif tok == "message":
            _parse_message(t, t.next(), full, pending, names, msg.nested_type.add())
        elif tok == "enum":
            enum_name = t.next()
            names[f"{full}.{enum_name}"] = "enum"
            msg.enum_type.add().CopyFrom(_parse_enum(t, enum_name))
        elif tok == "oneof":
            oneof_index = len(msg.oneof_decl)
            msg.oneof_decl.add(name=t.next())
            t.expect("{")
            while t.peek() != "}":
                field = _parse_field(t, None, full, pending, msg.field.add())
                field.oneof_index = oneof_index
            t.expect("}")
        elif tok in ("repeated", "optional"):
            field = _parse_field(t, tok, full, pending, msg.field.add())
            if tok == "optional":
                field.proto3_optional = True
                synthetic.append(field)
        elif tok in ("required", "group", "extensions", "extend"):
            raise t.error(f"{tok!r} is not supported by this loader")
        else:
            t.i -= 1
            _parse_field(t, None, full, pending, msg.field.add())
    # Synthetic oneofs of proto3 `optional` fields come after every real oneof.
    for field in synthetic:
        field.oneof_index = len(msg.oneof_decl)
        msg.oneof_decl.add(name=f"_{field.name}")
    return msg


def _resolve(type_word: str, scope: str, names: dict[str, str]) -> tuple[str, str] | None:
    if type_word.startswith("."):
        full = type_word[1:]
        return (full, names[full]) if full in names else None
    parts = scope.split(".")
    while parts:
        candidate = ".".join([*parts, type_word])
        if candidate in names:
            return candidate, names[candidate]
        parts.pop()
    return (type_word, names[type_word]) if type_word in names else None


def parse_proto(text: str, path: str = PROTO_RELATIVE) -> descriptor_pb2.FileDescriptorProto:
    """Parses proto3 source into a FileDescriptorProto named `path`."""
    t = _Tokens(text, path)
    fdp = descriptor_pb2.FileDescriptorProto(name=path)
    pending: list[_PendingField] = []
    names: dict[str, str] = {}
    while (tok := t.peek()) is not None:
        t.next()
        if tok == "syntax":
            t.expect("=")
            syntax = t.next().strip('"')
            if syntax != "proto3":
                raise t.error(f"syntax {syntax!r}: only proto3 is supported")
            fdp.syntax = syntax
            t.expect(";")
        elif tok == "package":
            fdp.package = t.next()
            t.expect(";")
        elif tok == "option":
            _skip_statement(t)
        elif tok == "message":
            _parse_message(t, t.next(), fdp.package, pending, names, fdp.message_type.add())
        elif tok == "enum":
            name = t.next()
            names[f"{fdp.package}.{name}"] = "enum"
            fdp.enum_type.add().CopyFrom(_parse_enum(t, name))
        else:
            raise t.error(f"unsupported top-level statement {tok!r}")
    if fdp.syntax != "proto3":
        raise SchemaError(path, 1, 'missing `syntax = "proto3";`')
    for p in pending:
        if p.type_name is None:
            continue
        resolved = _resolve(p.type_name, p.scope, names)
        if resolved is None:
            raise SchemaError(path, 0, f"field {p.scope}.{p.proto.name}: unknown type {p.type_name!r}")
        full, kind = resolved
        p.proto.type_name = f".{full}"
        p.proto.type = _F.TYPE_ENUM if kind == "enum" else _F.TYPE_MESSAGE
    return fdp


class Schema:
    """Message classes and enum descriptors of one parsed .proto file."""

    def __init__(self, fdp: descriptor_pb2.FileDescriptorProto) -> None:
        self.file_proto = fdp
        self.pool = descriptor_pool.DescriptorPool()
        self.pool.Add(fdp)
        self.file = self.pool.FindFileByName(fdp.name)
        self.package = fdp.package

    def message(self, name: str) -> type[Any]:
        return message_factory.GetMessageClass(self.pool.FindMessageTypeByName(f"{self.package}.{name}"))

    def enum_values(self, name: str) -> dict[str, int]:
        enum = self.pool.FindEnumTypeByName(f"{self.package}.{name}")
        return {v.name: v.number for v in enum.values}

    def enum_names(self) -> list[str]:
        return [e.name for e in self.file_proto.enum_type]


@lru_cache(maxsize=1)
def load_schema() -> Schema:
    """The runtime-core schema from the repository's .proto (cached)."""
    path = proto_path()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise SchemaError(str(path), 0, f"cannot read the runtime-core schema: {e}") from e
    return Schema(parse_proto(text, PROTO_RELATIVE))
