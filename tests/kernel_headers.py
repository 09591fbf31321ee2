"""Values out of the kernel's uapi headers, for tests that check hard-coded constants.

A small reader of ``#define NAME value`` and ``enum`` members in C headers
under /usr/include (``linux-libc-dev``, installed by deploy/host/install-deps.sh).
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

INCLUDE = Path("/usr/include")
NBD_NETLINK_H = INCLUDE / "linux/nbd-netlink.h"
NBD_H = INCLUDE / "linux/nbd.h"
NETLINK_H = INCLUDE / "linux/netlink.h"
GENETLINK_H = INCLUDE / "linux/genetlink.h"
IOCTL_H = INCLUDE / "asm-generic/ioctl.h"


def _c_int(node: ast.expr, env: dict[str, int | str]) -> int:
    match node:
        case ast.Constant(value=int() as v):
            return v
        case ast.Name(id=name) if isinstance(env.get(name), int):
            value = env[name]
            assert isinstance(value, int)
            return value
        case ast.UnaryOp(op=ast.Invert(), operand=o):
            return ~_c_int(o, env)
        case ast.UnaryOp(op=ast.USub(), operand=o):
            return -_c_int(o, env)
        case ast.BinOp(left=a, op=op, right=b):
            x, y = _c_int(a, env), _c_int(b, env)
            ops = {ast.LShift: x << y, ast.BitOr: x | y, ast.BitAnd: x & y, ast.Add: x + y}
            if type(op) is ast.Sub:
                return x - y
            return ops[type(op)]
        case ast.Call(func=ast.Name(id="_IO"), args=[a, b]):
            # _IO(type, nr) = _IOC(_IOC_NONE, type, nr, 0), shifts from asm-generic/ioctl.h.
            return (
                _c_int(ast.Name("_IOC_NONE"), env) << _c_int(ast.Name("_IOC_DIRSHIFT"), env)
                | _c_int(a, env) << _c_int(ast.Name("_IOC_TYPESHIFT"), env)
                | _c_int(b, env) << _c_int(ast.Name("_IOC_NRSHIFT"), env)
            )
    raise ValueError(ast.dump(node))


def header_constants(path: Path, env: dict[str, int | str] | None = None) -> dict[str, int | str]:
    """#define NAME value and enum members of a C header, in order; unevaluable ones left out."""
    known: dict[str, int | str] = dict(env or {})
    text = re.sub(r"/\*.*?\*/", " ", path.read_text(), flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    found: dict[str, int | str] = {}
    items: list[tuple[int, str, str | None, bool]] = []
    for m in re.finditer(r"^[ \t]*#[ \t]*define[ \t]+(\w+)(?!\()[ \t]+(.+?)[ \t]*$", text, re.M):
        items.append((m.start(), m.group(1), m.group(2), False))
    for m in re.finditer(r"\benum\b[^{;]*\{(.*?)\}", text, re.S):
        first = True
        for entry in m.group(1).split(","):
            entry = entry.strip()
            if entry:
                name, _, expr = entry.partition("=")
                items.append((m.start(), name.strip(), expr.strip() or None, first))
                first = False
    previous = -1
    for _, name, expr, first_in_enum in sorted(items, key=lambda i: i[0]):
        if first_in_enum:
            previous = -1
        try:
            if expr is None:  # enum member without a value
                value: int | str = previous + 1
            elif string := re.fullmatch(r'"([^"]*)"', expr):
                value = string.group(1)
            else:
                expr = re.sub(r"\b(0[xX][0-9a-fA-F]+|\d+)[uUlL]+\b", r"\1", expr)
                value = _c_int(ast.parse(expr, mode="eval").body, known)
        except (ValueError, SyntaxError, KeyError):
            continue
        if isinstance(value, int):
            previous = value
        known[name] = found[name] = value
    return found


def _require(path: Path) -> Path:
    assert path.exists(), f"{path} missing: install linux-libc-dev (deploy/host/install-deps.sh)"
    return path


def compiled_values(headers: list[str], printfs: list[str], directory: Path) -> dict[str, int]:
    """What the C compiler makes of ``headers``: a program of ``printfs`` (each
    printing ``name value``) built with gcc in ``directory`` and run; name -> value."""
    includes = "".join(f"#include <{h}>\n" for h in ["stddef.h", "stdio.h", *headers])
    source = includes + "int main(void) {\n" + "\n".join(printfs) + "\nreturn 0;\n}\n"
    c_file, binary = directory / "values.c", directory / "values"
    c_file.write_text(source)
    compiled = subprocess.run(
        ["gcc", "-o", str(binary), str(c_file)], capture_output=True, text=True, timeout=60
    )
    assert compiled.returncode == 0, compiled.stderr
    out = subprocess.run([str(binary)], capture_output=True, text=True, timeout=10, check=True)
    return {name: int(value) for name, value in (line.split() for line in out.stdout.splitlines())}
