"""Layout rules (docs/ARCHITECTURE.md): imports inside ``localdiff/`` flow one way — cli → {tui, serve} → engine →
{decoding, cache, quantize, backends} → arch → kernels, with loader and hub beside — and form no cycle; ``arch``
imports only arch / kernels / errors / units; ``kernels`` (the native C kernels) only kernels / errors; decoders work
on logits and ids; the chat talks to the engine only."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "localdiff"

#: top-level part → parts it must never import (function-level imports included)
FORBIDDEN = {
    "arch": {
        "engine",
        "loader",
        "cli",
        "tui",
        "serve",
        "decoding",
        "cache",
        "quantize",
        "hub",
        "bench",
        "backends",
        "config",
        "summary",
        "tokenizer",
    },
    "decoding": {"engine", "loader", "cli", "tui", "serve", "hub", "bench", "cache", "quantize"},
    "cache": {"engine", "loader", "cli", "tui", "serve", "decoding", "hub", "bench"},
    "quantize": {"engine", "cli", "tui", "serve", "decoding", "hub", "bench"},
    "tui": {"hub", "cli", "serve", "loader", "bench"},
    "engine": {"cli", "tui", "serve", "bench"},
    "hub": {"engine", "cli", "tui", "serve", "decoding", "cache", "bench"},
    "kernels": {
        "arch",
        "engine",
        "loader",
        "cli",
        "tui",
        "serve",
        "decoding",
        "cache",
        "quantize",
        "hub",
        "bench",
        "backends",
        "config",
        "summary",
        "tokenizer",
    },
}


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    graph = {}
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for n in names:
                while n and n not in mods:
                    n = n.rsplit(".", 1)[0] if "." in n else ""
                if n and n != m and not (n.startswith(m + ".") or m.startswith(n + ".")):
                    deps.add(n)
        graph[m] = deps
    return graph


def _part(m: str) -> str:
    return m.split(".")[1] if "." in m else ""


def test_no_import_cycles():
    graph = _imports(_modules())
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(v):
        state[v] = 1
        stack.append(v)
        for w in graph[v]:
            if state.get(w) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(w) :] + [w]))
            if w not in state:
                visit(w)
        stack.pop()
        state[v] = 2

    for v in graph:
        if v not in state:
            visit(v)


def test_imports_follow_the_allowed_direction():
    bad = [
        f"{a} -> {b}"
        for a, deps in _imports(_modules()).items()
        for b in deps
        if _part(b) in FORBIDDEN.get(_part(a), ())
    ]
    assert not bad, bad


def test_the_checker_sees_a_violation(tmp_path, monkeypatch):
    """The rules above can fail: a module of arch importing the engine is reported."""
    mods = _modules()
    fake = tmp_path / "x.py"
    fake.write_text("from localdiff.engine import Model\n")
    mods["localdiff.arch.x"] = fake
    deps = _imports(mods)["localdiff.arch.x"]
    assert "localdiff.engine" in deps and "engine" in FORBIDDEN["arch"]


def test_files_stay_under_about_400_lines():
    big = [
        f"{p.relative_to(PKG.parent)} ({n})"
        for p in PKG.rglob("*.py")
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > 400
    ]
    assert not big, big


def test_arch_imports_only_arch_kernels_errors_units():
    """The positive form of arch's rule (the blacklist above let a new top-level module slip in)."""
    graph = _imports(_modules())
    allowed = {"localdiff.errors", "localdiff.units"}
    bad = {
        m: sorted(d for d in deps if not d.startswith(("localdiff.arch", "localdiff.kernels")) and d not in allowed)
        for m, deps in graph.items()
        if m.startswith("localdiff.arch")
    }
    assert not {m: d for m, d in bad.items() if d}, bad


def test_kernels_sit_at_the_bottom():
    """``localdiff.kernels`` imports only itself and ``localdiff.errors``; every C source sits in it, beside its
    loader (one build-and-cache module, ``kernels/build.py``)."""
    graph = _imports(_modules())
    bad = {
        m: sorted(d for d in deps if not d.startswith("localdiff.kernels") and d != "localdiff.errors")
        for m, deps in graph.items()
        if m.startswith("localdiff.kernels")
    }
    assert not {m: d for m, d in bad.items() if d}, bad
    sources = sorted(p.relative_to(PKG).as_posix() for p in PKG.rglob("*.c"))
    assert sources and all(s.startswith("kernels/") and (PKG / s).with_suffix(".py").is_file() for s in sources), (
        sources
    )


def test_every_registry_family_is_listed_and_every_listed_family_runs():
    """``arch.base.FAMILIES`` names exactly the registry's families, and each of them but "drafts" (attached to a
    causal target, never run alone) has a runner and a default decoder."""
    from localdiff.arch import REGISTRY
    from localdiff.arch.base import FAMILIES
    from localdiff.decoding.options import has_decoder
    from localdiff.engine import RUNNERS

    assert {e.family for e in REGISTRY.values()} == set(FAMILIES)
    assert set(RUNNERS) == set(FAMILIES) - {"drafts"}
    assert all(has_decoder(f) for f in RUNNERS)


def test_model_type_aliases_are_resolved_once_by_the_registry():
    """Specs ask the registry (``localdiff.arch.canonical_type``) instead of keeping their own alias tables."""
    from localdiff.arch import canonical_type

    assert canonical_type({"model_type": "llada", "architectures": ["LLaDAMoEModelLM"]}) == "lladamoe"
    assert canonical_type({"model_type": "dream"}) == "Dream"
    assert canonical_type({"model_type": "a2d-qwen3", "block_size": 4}) == "a2d-qwen3-bd3lm"
    assert canonical_type({"model_type": "qwen3", "mask_token_id": 5}) == "refusion"
    specs = [p for p in (PKG / "arch").glob("*_spec.py")]
    assert not [p.name for p in specs if "def canonical_type" in p.read_text(encoding="utf-8")]
