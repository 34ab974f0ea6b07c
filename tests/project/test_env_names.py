"""``LOCALDIFF_*`` environment names: every subcommand refuses an unknown one with the line ``gen`` gives (exit 2,
nothing on stdout, before any work), and every name the package itself reads is a known one (so that check never
refuses a variable localdiff uses)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from localdiff.cli import main
from localdiff.config import known_environment

PKG = Path(__file__).resolve().parents[2] / "localdiff"
LINE = (
    "error: unknown environment variable LOCALDIFF_MODLE (did you mean LOCALDIFF_MODEL?); unset it or use a "
    "known LOCALDIFF_* name"
)
COMMANDS = [
    ["gen", "-p", "x"],
    ["list"],
    ["ls", "--json"],
    ["pull", "tiny"],
    ["rm", "acme/x"],
    ["show", "tiny"],
    ["config", "path"],
    ["quantize", "tiny", "-o", "nowhere"],
    ["bench", "--quick"],
    ["chat"],
    ["serve", "--port", "1"],
    ["gen", "--endpoint", "http://127.0.0.1:1", "-p", "x"],
]


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(a[:2]) for a in COMMANDS])
def test_every_subcommand_refuses_an_unknown_localdiff_variable_as_gen_does(argv, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("LOCALDIFF_MODLE", "tiny")
    monkeypatch.setenv("LOCALDIFF_CONFIG", str(tmp_path / "none.toml"))
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [LINE]


def test_a_known_variable_passes(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("LOCALDIFF_INT8_KERNEL", "auto")  # read by localdiff.quantize.int8
    monkeypatch.setenv("LOCALDIFF_CONFIG", str(tmp_path / "none.toml"))
    assert main(["config", "path"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "none.toml")


def _names_read() -> dict[str, str]:
    """Each ``LOCALDIFF_*`` string constant in the package's code (not prose) → the first file holding it."""
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and re.fullmatch(r"LOCALDIFF_[A-Z0-9_]+", node.value)
            ):
                out.setdefault(node.value, str(p.relative_to(PKG.parent)))
    return out


def test_every_variable_the_package_reads_is_known():
    names = _names_read()
    assert "LOCALDIFF_DATA_DIR" in names and "LOCALDIFF_INT8_KERNEL" in names  # the scan sees what it should
    unknown = {n: f for n, f in names.items() if n not in known_environment()}
    assert not unknown, f"read but not in config._ENV_OTHER / _ENV_TOP / the option schema: {unknown}"
