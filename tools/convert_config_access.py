"""Rewrite flat config accesses (``cfg.lr``) to the sectioned form (``cfg.optim.lr``), once.

    python tools/convert_config_access.py                 # chunk_grpo/, tests/, benchmarks/
    python tools/convert_config_access.py --check         # list what would change, write nothing
    python tools/convert_config_access.py --remove-shim   # also drop config.py's transition shim
    python tools/convert_config_access.py --names model,reward,chunks chunk_grpo/train/loop.py

Not part of the package: a one-off for the move to a nested `TrainConfig`. The mapping is
`chunk_grpo.config.schema.FLAT_ALIASES`. What it rewrites, on receivers that hold a TrainConfig
(`RECEIVERS`: cfg, config, base_cfg, self.cfg, tr.cfg, trainer.cfg, cfgs[...], TrainConfig(),
build_config(...), load_saved_config(...)):
  - ``cfg.lr`` -> ``cfg.optim.lr`` (reads and writes; ``cfg.model`` -> ``cfg.model.name``, except
    where a section key already follows: ``cfg.model.height`` is left alone);
  - ``getattr(cfg, "lr")`` -> ``cfg.optim.lr``; ``getattr(cfg, key)`` -> ``cfg.get(key)``;
  - ``dataclasses.replace(cfg, lr=x, **more)`` -> ``cfg.with_changes({"optim.lr": x, **more})``
    (``more``'s flat keys are aliases ``with_changes`` takes);
  - ``TrainConfig(lr=x)`` -> ``TrainConfig().with_changes({"optim.lr": x})``;
  - ``cfg = SimpleNamespace(lr=x, eta=y)`` (a test's stand-in) -> nested namespaces by section;
  - then drops an ``import dataclasses`` left unused.
Flat keys in override dicts (``build_config(None, {"group_size": 4})``) stay: they are aliases.
Run ``ruff check --fix`` and the tests afterwards.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from chunk_grpo.config.schema import FLAT_ALIASES, PATHS, SECTIONS  # noqa: E402

DEFAULT_DIRS = ("chunk_grpo", "tests", "benchmarks")
# Already written in the sectioned form (and the shim's own code).
SKIP = {Path("chunk_grpo/config/schema.py"), Path("chunk_grpo/config/checks.py"),
        # its examples are the old form on purpose
        Path("tests/unit/config/test_convert_config_access.py")}
SHIM_FILES = {Path("chunk_grpo/config/schema.py"), Path("tests/unit/config/test_train_config.py")}
LINE_LENGTH = 100
RECEIVERS = (r"cfg", r"config", r"base_cfg", r"self\.cfg", r"tr\.cfg", r"trainer\.cfg",
             r"cfgs\[[^\]\n]+\]", r"TrainConfig\(\)", r"build_config\([^()\n]*\)",
             r"load_saved_config\([^()\n]*\)")
RECEIVER = "(?:" + "|".join(RECEIVERS) + ")"
_RECEIVER_RE = re.compile(rf"^{RECEIVER}$")
SHIM = re.compile(r"^[ \t]*# >>> TRANSITION SHIM.*?^[ \t]*# <<< TRANSITION SHIM[^\n]*\n",
                  re.M | re.S)


def _leaf_names(section: str) -> set[str]:
    return {p.split(".")[1] for p in PATHS if p.startswith(section + ".")}


def convert_attributes(text: str, names: set[str]) -> str:
    """``recv.flat`` -> ``recv.section.leaf``; ``getattr(recv, ...)`` likewise."""

    def getattr_literal(m: re.Match) -> str:
        flat = m.group("key")
        if flat not in names:
            return m.group(0)
        return f"{m.group('recv')}.{FLAT_ALIASES[flat]}"

    text = re.sub(rf"\bgetattr\((?P<recv>{RECEIVER}),\s*[\"'](?P<key>\w+)[\"']\)",
                  getattr_literal, text)
    text = re.sub(rf"\bgetattr\((?P<recv>{RECEIVER}),\s*(?P<key>[A-Za-z_]\w*)\)",
                  lambda m: f"{m.group('recv')}.get({m.group('key')})", text)

    def attribute(m: re.Match) -> str:
        flat = m.group("flat")
        if flat not in names:
            return m.group(0)
        if flat in SECTIONS:  # a section's own name: converted unless a key of it follows
            after = re.match(r"\.(\w+)", text[m.end():])
            if after and after.group(1) in _leaf_names(flat):
                return m.group(0)
        return f"{m.group('recv')}.{FLAT_ALIASES[flat]}"

    flat_names = "|".join(sorted(FLAT_ALIASES, key=len, reverse=True))
    return re.sub(rf"(?<![\w.])(?P<recv>{RECEIVER})\.(?P<flat>{flat_names})\b", attribute, text)


def _offset(lines: list[str], line: int, col: int) -> int:
    """The character offset of an AST (line, byte column)."""
    return sum(len(s) for s in lines[:line - 1]) + len(lines[line - 1].encode()[:col].decode())


def _call_name(node: ast.Call) -> str:
    func = node.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return f"{func.value.id}.{func.attr}"
    return func.id if isinstance(func, ast.Name) else ""


def _wrapped(head: str, items: list[str], tail: str, column: int, indent: str) -> str:
    """``head + items + tail`` on one line if it fits from ``column``, else the items wrapped
    on lines of their own, indented by ``indent`` plus four spaces."""
    one_line = head + ", ".join(items) + tail
    if column + len(one_line) <= LINE_LENGTH:
        return one_line
    lines, line, pad = [], "", indent + " " * 4
    for item in items:
        if line and len(pad) + len(line) + len(item) + 3 > LINE_LENGTH:
            lines.append(pad + line + ",")
            line = ""
        line = f"{line}, {item}" if line else item
    return head + "\n" + "\n".join([*lines, pad + line]) + tail


def _changes_dict(text: str, keywords: list[ast.keyword]) -> list[str]:
    items = []
    for kw in keywords:
        value = ast.get_source_segment(text, kw.value)
        items.append(f"**{value}" if kw.arg is None else f'"{FLAT_ALIASES[kw.arg]}": {value}')
    return items


def _nested_namespace(text: str, keywords: list[ast.keyword]) -> list[str]:
    by_section: dict[str, list[str]] = {}
    for kw in keywords:
        section, leaf = FLAT_ALIASES[kw.arg].split(".")
        by_section.setdefault(section, []).append(
            f"{leaf}={ast.get_source_segment(text, kw.value)}")
    return [f"{s}=SimpleNamespace({', '.join(v)})" for s, v in by_section.items()]


def convert_calls(text: str, names: set[str]) -> str:
    """replace(...), TrainConfig(...) and a stand-in SimpleNamespace(...) with flat names."""
    tree = ast.parse(text)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    edits: list[tuple[int, int, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name, kws = _call_name(node), node.keywords
        flat = [kw.arg for kw in kws if kw.arg is not None]
        if not kws or not all(k in FLAT_ALIASES for k in flat) or (flat and not set(flat) & names):
            continue
        new = None
        line = text.splitlines()[node.lineno - 1]
        column = len(line.encode()[:node.col_offset].decode())
        indent = line[:len(line) - len(line.lstrip())]
        if name in ("dataclasses.replace", "replace") and len(node.args) == 1:
            receiver = ast.get_source_segment(text, node.args[0])
            if _RECEIVER_RE.match(receiver or ""):
                items = _changes_dict(text, kws)
                new = (f"{receiver}.with_changes({items[0][2:]})" if len(kws) == 1 and not flat
                       else _wrapped(f"{receiver}.with_changes({{", items, "})", column, indent))
        elif name == "TrainConfig" and not node.args and flat:
            new = _wrapped("TrainConfig().with_changes({", _changes_dict(text, kws), "})",
                           column, indent)
        elif name == "SimpleNamespace" and not node.args and flat and all(kw.arg for kw in kws):
            parent = parents.get(node)
            targets = parent.targets if isinstance(parent, ast.Assign) else []
            if any(isinstance(t, ast.Name) and _RECEIVER_RE.match(t.id) for t in targets):
                new = _wrapped("SimpleNamespace(", _nested_namespace(text, kws), ")", column,
                               indent)
        if new is not None:
            edits.append((node.lineno, node.col_offset, node.end_lineno, node.end_col_offset, new))
    lines = text.splitlines(keepends=True)
    spans = sorted(((_offset(lines, a, b), _offset(lines, c, d), new)
                    for a, b, c, d, new in edits), reverse=True)
    last_start = len(text) + 1
    for start, end, new in spans:  # from the end; an edit inside an earlier one is skipped
        if end <= last_start:
            text = text[:start] + new + text[end:]
            last_start = start
    return text


def drop_unused_dataclasses_import(text: str) -> str:
    if "dataclasses." in text.replace("import dataclasses", ""):
        return text
    return re.sub(r"^import dataclasses\n", "", text, flags=re.M)


def convert(text: str, names: set[str]) -> str:
    return drop_unused_dataclasses_import(convert_attributes(convert_calls(text, names), names))


def remove_shim(text: str) -> str:
    return re.sub(r"\n{4,}", "\n\n\n", SHIM.sub("", text))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="files or directories (default: "
                        f"{', '.join(DEFAULT_DIRS)} under {ROOT})")
    parser.add_argument("--check", action="store_true", help="list the changes, write nothing")
    parser.add_argument("--remove-shim", action="store_true",
                        help="also delete the TRANSITION SHIM blocks (config.py and its test)")
    parser.add_argument("--names", help="only these flat names (comma-separated)")
    args = parser.parse_args(argv)
    names = set(args.names.split(",")) if args.names else set(FLAT_ALIASES)
    unknown = names - set(FLAT_ALIASES)
    if unknown:
        parser.error(f"not flat config names: {', '.join(sorted(unknown))}")
    roots = [Path(p) for p in args.paths] or [ROOT / d for d in DEFAULT_DIRS]
    files = sorted({f for r in roots for f in ([r] if r.is_file() else r.rglob("*.py"))})
    changed = 0
    for path in files:
        rel = path.resolve().relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else path
        old = path.read_text()
        new = old if rel in SKIP else convert(old, names)
        if args.remove_shim and rel in SHIM_FILES:
            new = remove_shim(new)
        if new == old:
            continue
        long_lines = [n for n, line in enumerate(new.splitlines(), 1) if len(line) > LINE_LENGTH
                      and n not in {m for m, old_line in enumerate(old.splitlines(), 1)
                                    if old_line == line}]
        changed += 1
        diff = [d for d in difflib.unified_diff(old.splitlines(), new.splitlines(), lineterm="",
                                                n=0) if d[:1] in "+-" and d[:3] not in "+++---"]
        print(f"{rel}: {sum(d.startswith('-') for d in diff)} line(s) rewritten"
              + (f"; longer than {LINE_LENGTH} now, wrap by hand: lines "
                 f"{', '.join(map(str, long_lines))}" if long_lines else ""))
        if args.check:
            print("\n".join("    " + d for d in diff))
        else:
            path.write_text(new)
    print(f"{changed} file(s) {'would change' if args.check else 'changed'}"
          + ("" if args.check else "; now run `ruff check --fix .` (imports left unused)"))
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    raise SystemExit(main())
