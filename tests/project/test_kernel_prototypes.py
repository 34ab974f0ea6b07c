"""Every native kernel's ctypes declaration (``localdiff.kernels.build.declare`` prototypes) matches the C function it
calls: same exported names, same return type, same argument count and kinds (any pointer → ``void*``). A drift here
would pass wrong arguments to C without an error."""

import ctypes
import importlib
import re
from pathlib import Path

import pytest

from localdiff.kernels import build

KERNELS = Path(build.__file__).parent
MODULES = sorted(p.stem for p in KERNELS.glob("*.c"))


def _c_exports(source: str) -> dict[str, tuple[str, list[str]]]:
    """{name: (return type, [argument kinds])} of the ``localdiff_*`` functions a C file defines."""
    out = {}
    for ret, name, params in re.findall(r"^(int|void|float)\s+(localdiff_\w+)\(([^)]*)\)\s*\{", source, re.M | re.S):
        kinds = []
        for p in params.split(","):
            p = " ".join(p.split())
            if not p or p == "void":
                continue
            kinds.append("void*" if "*" in p else p.replace("const ", "").split()[0])
        out[name] = (ret, kinds)
    return out


class _Fn:
    restype = argtypes = None


class _Lib:
    def __init__(self, path):
        self.fns = {}

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self.fns.setdefault(name, _Fn())


_NAMES = {v: k for k, v in build._C_TYPES.items()}


def _declared(module: str, monkeypatch) -> dict[str, tuple[str, list[str]]]:
    mod = importlib.import_module(f"localdiff.kernels.{module}")
    monkeypatch.setattr(ctypes, "CDLL", _Lib)
    lib = (getattr(mod, "load", None) or mod._load)("unused")
    return {n: (_NAMES[f.restype], [_NAMES[a] for a in f.argtypes]) for n, f in lib.fns.items()}


def test_every_kernel_source_has_a_module():
    assert len(MODULES) >= 7 and all((KERNELS / f"{m}.py").exists() for m in MODULES)


@pytest.mark.parametrize("module", MODULES)
def test_ctypes_prototypes_match_the_c_source(module, monkeypatch):
    exported = _c_exports((KERNELS / f"{module}.c").read_text())
    declared = _declared(module, monkeypatch)
    assert declared, f"{module}.py declares no function"
    for name, proto in declared.items():
        assert name in exported, f"{module}.py declares {name}, which {module}.c does not define"
        assert proto == exported[name], f"{name}: declared {proto}, C has {exported[name]}"


def test_the_parser_reads_what_c_writes():
    src = "int localdiff_f(const uint16_t *q, long n,\n    float s, int t) {\n}\nint localdiff_g(void) { return 1; }"
    assert _c_exports(src) == {
        "localdiff_f": ("int", ["void*", "long", "float", "int"]),
        "localdiff_g": ("int", []),
    }


def test_declare_refuses_an_unknown_type():
    with pytest.raises(KeyError):
        build.declare(_Lib(None), "int localdiff_f(double)")
