"""``docs/UPSTREAM_OPTIONS.md`` (issue #45) maps every parameter of the upstream generate functions (SDAR, LLaDA,
Fast-dLLM v1 / v2, Dream, LLaDA2.x, dInfer) to localdiff. These tests keep it true to the code: every "supported as"
cell names only things localdiff has (a ``localdiff gen`` flag with a value it accepts, a decoder option, a
``Model.stream`` keyword or method, a field ``localdiff show`` prints, a decoder policy, a server request field, a
catalog name or a repository file), every "not supported" cell gives a reason, each table names the upstream file's
commit, the summary counts are the tables', and every option of the upstream-derived decoders is mapped somewhere."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "UPSTREAM_OPTIONS.md").read_text(encoding="utf-8")
SUPPORTED, MISSING = "supported as ", "not supported, because "
#: the decoders whose options come from these upstreams: each of their options must be mapped from some parameter
UPSTREAM_POLICIES = ("sdar", "fast_dllm_v2", "llada", "dream", "llada2")


def _sections() -> dict[str, str]:
    """'## title' → its body (the text before the first section is left out)."""
    parts = re.split(r"^## (.+)$", DOC, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def _rows(body: str) -> list[list[str]]:
    """The data rows of the section's table, as lists of cells (header and separator rows dropped)."""
    lines = [ln.strip() for ln in body.splitlines() if ln.strip().startswith("|")]
    return [[c.strip() for c in ln.strip("|").split(" | ")] for ln in lines[2:]]


def _tables() -> dict[str, list[list[str]]]:
    return {title: _rows(body) for title, body in _sections().items() if title != "Summary"}


class Known:
    """Everything a "supported as" reference may name, gathered from the code."""

    def __init__(self):
        from localdiff import config
        from localdiff.cli.dispatch import build_parser
        from localdiff.decoding.options import ALIASES, POLICIES
        from localdiff.engine import Model
        from localdiff.serve.openai_api import _COMMON
        from localdiff.summary import summarize

        self.flags = build_parser()._subparsers._group_actions[0].choices["gen"]._option_string_actions
        self.specs = [s for c in POLICIES.values() for s in c.specs()]
        self.options = {s.name for s in self.specs} | set(ALIASES)
        self.names = set(self.options) | set(config._TOP_KEYS) | set(POLICIES) | set(_COMMON)
        self.names |= set(inspect.signature(Model.stream).parameters) - {"self", "sampler_options"}
        self.names |= {n for n in dir(Model) if not n.startswith("_")}
        for cfg in sorted(ROOT.glob("models/**/config.json")):
            if "recipe" not in cfg.parts:
                self.names |= set(summarize(json.loads(cfg.read_text()), cfg.parent))

    def _accepts(self, specs, value: str) -> bool:
        from localdiff.errors import UsageError

        for spec in specs:
            try:
                spec.coerce(value, "doc")
                return True
            except UsageError:
                pass
        return False

    def check(self, ref: str) -> str | None:
        """None when ``ref`` names something localdiff has, else why not."""
        from localdiff.hub.catalog import lookup

        if ref.startswith("-"):
            flag, _, value = ref.partition(" ")
            if flag not in self.flags:
                return f"{flag}: no such flag of localdiff gen"
            if value:
                specs = [s for s in self.specs if s.cli_flag == flag]
                choices = self.flags[flag].choices
                ok = self._accepts(specs, value) if specs else (choices is None or value in choices)
                if not ok:
                    return f"{flag} does not accept {value!r}"
            return None
        if "=" in ref:
            name, _, value = ref.partition("=")
            specs = [s for s in self.specs if s.name == name or name in s.aliases]
            if not specs:
                return f"{name}: no such decoder option"
            return None if self._accepts(specs, value) else f"{name} does not accept {value!r}"
        if ref in self.names or lookup(ref) is not None or ("/" in ref and (ROOT / ref).exists()):
            return None
        return f"{ref}: not a flag, option, API name, show field, policy, request field, catalog name or file"


@pytest.fixture(scope="module")
def known() -> Known:
    return Known()


def test_the_document_has_the_upstream_functions_the_issue_lists():
    titles = " ".join(_tables())
    for upstream in (
        "SDAR",
        "LLaDA `generate`",
        "Fast-dLLM v1 LLaDA",
        "Fast-dLLM v1 Dream",
        "Fast-dLLM v2",
        "Dream",
        "LLaDA2.0",
        "LLaDA2.1",
        "dInfer",
    ):
        assert upstream in titles, upstream


@pytest.mark.parametrize("title", list(_tables()))
def test_every_cell_is_supported_as_something_localdiff_has_or_says_why_not(title, known):
    rows = _tables()[title]
    assert rows, f"{title}: no table"
    for row in rows:
        assert len(row) == 3, (title, row)
        cell = row[2]
        if cell.startswith(MISSING):
            assert len(cell[len(MISSING) :].split()) >= 4, (title, row[0], "give the reason")
            continue
        assert cell.startswith(SUPPORTED), (title, row[0], "a cell starts 'supported as' or 'not supported, because'")
        refs = re.findall(r"`([^`]+)`", cell)
        assert refs, (title, row[0], "name what it is supported as, in backticks")
        bad = [why for why in map(known.check, refs) if why]
        assert not bad, (title, row[0], bad)


@pytest.mark.parametrize("title", list(_tables()))
def test_each_table_names_the_upstream_file_and_commit_it_was_read_from(title):
    read = _sections()[title].split("|", 1)[0]
    assert read.lstrip().startswith("Read:"), title
    assert re.search(r"\b[0-9a-f]{40}\b", read), f"{title}: the commit read (40 hex digits)"
    assert re.search(r"`[\w./-]+\.(py|md)`", read), f"{title}: the upstream file"


def test_the_summary_counts_are_the_tables():
    tables = _tables()
    summary = {row[0]: tuple(int(x) for x in row[1:]) for row in _rows(_sections()["Summary"])}
    assert set(summary) == set(tables)
    for title, rows in tables.items():
        yes = sum(r[2].startswith(SUPPORTED) for r in rows)
        no = sum(r[2].startswith(MISSING) for r in rows)
        assert summary[title] == (len(rows), yes, no), title


def test_every_option_of_the_upstream_decoders_is_mapped(known):
    """The reverse direction: an option added to one of these decoders needs its upstream parameter in the
    document (or a new row)."""
    from localdiff.decoding.options import POLICIES

    cited = {
        ref.partition(" ")[0]
        for rows in _tables().values()
        for r in rows
        if r[2].startswith(SUPPORTED)
        for ref in re.findall(r"`([^`]+)`", r[2])
    }
    for policy in UPSTREAM_POLICIES:
        for spec in POLICIES[policy].specs():
            assert spec.cli_flag in cited or spec.name in cited, (policy, spec.name)


@pytest.mark.parametrize(
    "ref",
    [
        "--no-such-flag",
        "--kv-cache sideways",
        "--remasking-strategy eb",
        "--steps 0",
        "kv_cache=sideways",
        "no_such_option",
        "docs/NO_SUCH.md",
    ],
)
def test_the_checker_rejects_what_localdiff_does_not_have(known, ref):
    assert known.check(ref) is not None


@pytest.mark.parametrize(
    "ref",
    [
        "--kv-cache vicinity",
        "--remasking-strategy entropy_bounded",
        "-n",
        "--no-stop-at-eos",
        "kv_cache=none",
        "denoising_steps",
        "mask_token_id",
        "block_size",
        "attention_mask",
        "stream",
        "llada2",
        "stop",
        "llada2.1:mini",
        "localdiff/decoding/sdar.py",
    ],
)
def test_the_checker_accepts_what_localdiff_has(known, ref):
    assert known.check(ref) is None
