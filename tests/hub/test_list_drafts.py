"""DFlash drafts are listed as drafts (issue 40 item 7): ``localdiff list`` shows them apart from the models ready to
run, with the target they pair with; ``--json`` marks them; the server does not offer them (``/v1/models``,
``/api/tags``: tests/serve/test_serve_model_names.py) and ``serve -m`` refuses one; ``gen -m tiny-dflash`` keeps its
refusal."""

from __future__ import annotations

import json

import pytest

from localdiff.cli import main


@pytest.fixture
def no_pulls(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "config.toml").touch()  # a LOCALDIFF_CONFIG file must exist
    monkeypatch.setenv("LOCALDIFF_CONFIG", str(tmp_path / "config.toml"))


def _sections(out: str) -> tuple[list[str], list[str]]:
    """The list table's rows and the drafts table's rows (header lines dropped)."""
    head, _, drafts = out.partition("\nDFlash drafts")
    return head.splitlines()[1:], drafts.splitlines()[2:]


def test_list_shows_the_draft_apart_with_its_target(no_pulls, capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    ready, drafts = _sections(out)
    assert [r.split()[0] for r in ready] == ["tiny", "tiny-mdm", "tiny-bd", "tiny-refusion", "tiny-qwen3"]
    assert "DFlash drafts (not run alone: gen -m TARGET --draft NAME):" in out
    assert out.splitlines()[len(ready) + 3].split()[:2] == ["DRAFT", "FOR"]
    assert [r.split()[:3] for r in drafts] == [["tiny-dflash", "tiny-qwen3", "embedded"]]


def test_list_json_and_all_mark_drafts(no_pulls, capsys):
    assert main(["list", "--json"]) == 0
    rows = {m["name"]: m for m in json.loads(capsys.readouterr().out)}
    assert rows["tiny-dflash"]["draft"] is True and rows["tiny-dflash"]["draft_for"] == ["tiny-qwen3"]
    assert rows["tiny-qwen3"]["draft"] is False and "draft_for" not in rows["tiny-qwen3"]
    assert main(["list", "--all"]) == 0
    ready, drafts = _sections(capsys.readouterr().out)
    names = [r.split()[0] for r in drafts]
    assert names[0] == "tiny-dflash" and {"qwen3-4b-dflash", "qwen3-8b-dflash", "llama3.1-8b-dflash"} <= set(names)
    assert not any(r.split()[0].endswith("-dflash") for r in ready)
    assert any(r.split()[:2] == ["qwen3-8b-dflash", "qwen3:8b"] for r in drafts)


def test_gen_and_serve_refuse_a_draft_alone(no_pulls, capsys):
    assert main(["gen", "-m", "tiny-dflash", "-p", "x"]) == 2
    assert "tiny-dflash is a DFlash draft model" in capsys.readouterr().err
    import socket

    with socket.socket() as taken:  # refused before the port is tried (a free port would start a server)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(["serve", "-m", "tiny-dflash", "--port", str(taken.getsockname()[1])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a DFlash draft does not run alone" in err and "tiny-qwen3" in err
