"""edgellm/kernels/abi.py against the C headers it mirrors (csrc/edgellm_kernels.h, csrc/edgellm_decoder.h).

The compiler is the reference for types: a translation unit that includes the headers asserts, with
_Static_assert, every constant's value and every struct field's offset and type as abi.py declares them, and
redeclares every function with abi.py's parameter types (a C compiler refuses a conflicting redeclaration). The
other direction (something in C that abi.py lacks) is read from the headers' text and from the built library's
exported symbols: every constant, every struct field in order, every prototype and every exported el_* function.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from edgellm.kernels import abi, build, native
from edgellm.quant.layout import EL_FORMAT_CODES

HEADERS = ("edgellm_kernels.h", "edgellm_decoder.h")


def _header_text() -> str:
    """The public headers without comments."""
    text = "\n".join((build.CSRC / h).read_text() for h in HEADERS)
    return re.sub(r"/\*.*?\*/", " ", text, flags=re.S)


def _check_source() -> str:
    """C that compiles only if abi.py's declarations match the headers."""
    lines = ["#include <stddef.h>", *[f'#include "{h}"' for h in HEADERS]]
    for name, value in abi.CONSTANTS.items():
        lines.append(f'_Static_assert(({name}) == ({value}), "{name} is not {value}");')
    for struct in abi.STRUCTS.values():
        c = struct.c_name
        lines.append(f'_Static_assert(sizeof({c}) == {ctypes.sizeof(struct)}, "sizeof({c})");')
        for field, ctype in struct.c_fields:
            offset = getattr(struct, field).offset
            lines.append(f'_Static_assert(offsetof({c}, {field}) == {offset}, "{c}.{field} offset");')
            lines.append(f'_Static_assert(_Generic((({c} *)0)->{field}, {ctype}: 1, default: 0), '
                         f'"{c}.{field} is not {ctype}");')
    for fn in abi.FUNCTIONS:
        lines.append(f'_Static_assert(sizeof(&{fn.name}) > 0, "{fn.name} declared");')  # undeclared: an error
        lines.append(fn.c_declaration())  # conflicting types: an error
    return "\n".join(lines) + "\n"


def _compile_check(source: str, tmp_path: Path, include: Path = build.CSRC) -> subprocess.CompletedProcess[str]:
    cc = build.find_compiler()
    if cc is None:
        pytest.skip("no C compiler")
    (tmp_path / "abi_check.c").write_text(source)
    return subprocess.run([cc, "-std=c11", "-fsyntax-only", "-Werror", f"-I{include}", str(tmp_path / "abi_check.c")],
                          capture_output=True, text=True, timeout=120)


def test_every_declaration_compiles_against_the_headers(tmp_path: Path) -> None:
    proc = _compile_check(_check_source(), tmp_path)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(("header", "old", "new", "why"), [
    ("edgellm_decoder.h", "int32_t fmt;", "uint32_t fmt;", "el_matrix.fmt is not int32_t"),
    ("edgellm_decoder.h", "int32_t n, k;", "int32_t k, n;", "el_matrix.n offset"),
    ("edgellm_decoder.h", "EL_ERR_MEMORY = 3,", "EL_ERR_MEMORY = 4,", "EL_ERR_MEMORY is not 3"),
    ("edgellm_kernels.h", "int el_cpu_allows(const char *variant);", "int el_cpu_allows(char *variant);",
     "conflicting types"),
    ("edgellm_kernels.h", "uint64_t el_cpu_xcr0(void);", "", "el_cpu_xcr0"),
])
def test_a_header_that_drifts_fails_to_compile(tmp_path: Path, header: str, old: str, new: str, why: str) -> None:
    """The check itself: each edit of a header (a field's type or place, a value, a parameter, a prototype gone)
    stops the check's compile, naming what moved."""
    src = tmp_path / "csrc"
    shutil.copytree(build.CSRC, src)
    text = (src / header).read_text()
    assert old in text
    (src / header).write_text(text.replace(old, new))
    proc = _compile_check(_check_source(), tmp_path, include=src)
    assert proc.returncode != 0 and why in proc.stderr


def _struct_fields(text: str) -> dict[str, list[str]]:
    """{struct name: its field names in order} for every ``typedef struct { ... } name;`` of ``text``."""
    out = {}
    for body, name in re.findall(r"typedef struct\s*\{(.*?)\}\s*(\w+)\s*;", text, flags=re.S):
        fields = []
        for decl in filter(None, (d.strip() for d in body.split(";"))):
            declarators = decl.split(",")
            first = declarators[0].split()  # the type, then the first declarator
            for d in [first[-1], *declarators[1:]]:
                fields.append(re.sub(r"\[.*", "", d.strip().lstrip("*").strip()))
        out[name] = fields
    return out


def test_every_struct_field_of_the_headers_is_declared_in_order() -> None:
    fields = _struct_fields(_header_text())
    for struct in abi.STRUCTS.values():
        assert fields[struct.c_name] == [name for name, _ in struct.c_fields], struct.c_name


def test_every_constant_and_prototype_of_the_headers_is_declared() -> None:
    text = _header_text()
    enums = {n for body in re.findall(r"enum\s*\{(.*?)\}", text, flags=re.S) for n in re.findall(r"(EL_\w+)\s*=", body)}
    defines = set(re.findall(r"^#define\s+(EL_\w+)\s", text, flags=re.M))
    assert enums | defines == set(abi.CONSTANTS)
    prototypes = set(re.findall(r"^[A-Za-z_][\w \*]*?\b(el_\w+)\s*\(", text, flags=re.M))
    inline = set(re.findall(r"static inline [\w \*]*?\b(el_\w+)\s*\(", text))
    assert prototypes - inline == {f.name for f in abi.FUNCTIONS}


def _library() -> Path:
    for name in native.variant_names():
        if (path := native.library_path(name)).is_file():
            return path
    pytest.skip("no kernel library built")


def test_every_exported_function_is_declared() -> None:
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm")
    out = subprocess.run([nm, "-D", "--defined-only", str(_library())], capture_output=True, text=True,
                         check=True).stdout
    exported = {line.split()[-1] for line in out.splitlines() if line.split()[-1].startswith("el_")}
    assert exported == {f.name for f in abi.FUNCTIONS}


def test_error_strings_come_from_the_library() -> None:
    lib = abi.declare(ctypes.CDLL(str(_library())))
    codes = {name: value for name, value in abi.CONSTANTS.items() if name.startswith(("EL_ERR_", "EL_DESC_"))}
    words = {name: abi.strerror(lib, value) for name, value in codes.items()}
    assert len(set(words.values())) == len(words) and "unknown error code" not in words.values()
    assert abi.strerror(lib, abi.OK) == "ok" and abi.strerror(lib, 7) == "unknown error code"
    assert words["EL_ERR_TOKEN"] == "token id outside the vocabulary"
    assert lib.el_decoder_destroy(None) is None  # a void function: ctypes' restype None, not a converter


def test_the_python_side_uses_the_format_ids_of_the_abi() -> None:
    assert EL_FORMAT_CODES == {name: code for name, code in abi.FORMATS.items() if name != "f32"}
