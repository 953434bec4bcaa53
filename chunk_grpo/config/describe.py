"""How a config key is shown to a user: its comment in the source, its type, its default as
YAML. Shared by every command's ``--help`` and the generated docs/reference pages."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import tokenize
import types
import typing
from typing import Any


@functools.cache
def field_comments(cls: type) -> dict[str, str]:
    """{field: its comment}: the comment lines right above a field and the one beside it."""
    source = inspect.getsource(cls)
    lines = source.splitlines()
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}
    out = {}
    for f in dataclasses.fields(cls):
        row = next((i for i, line in enumerate(lines, 1)
                    if line.strip().startswith(f"{f.name}:")), None)
        if row is None:
            continue
        above, i = [], row - 1
        while i >= 1 and lines[i - 1].strip().startswith("#"):
            above.insert(0, comments[i])
            i -= 1
        beside = [comments[row]] if row in comments and not lines[row - 1].strip().startswith(
            "#") else []
        out[f.name] = "; ".join(part for part in [" ".join(above), *beside] if part)
    return out


def type_name(hint: Any) -> str:
    """``int or null``, ``list of str``, ``one of auto, no, bf16``."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Literal:
        return "one of " + ", ".join(map(str, args))
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else type_name(a) for a in args)
    if typing.get_origin(hint) is list:
        return f"list of {type_name(args[0])}"
    return getattr(hint, "__name__", str(hint))


def yaml_value(value: Any) -> str:
    """A value as it is written in YAML (and on the command line)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else '""'
    if isinstance(value, list):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    return repr(value)
