"""``localdiff pull`` of a GGUF repo (#17): one quantization file chosen by a tag (``org/repo:Q8_0``,
``org/repo --quant Q8_0``, a catalog ``<alias>-q8_0``), with the byte-level resume and verification of safetensors
pulls, against the local Hub stand-in; ``list`` / ``show`` tell the backend and the quantization."""

from __future__ import annotations

import json

import pytest

from hub_stand_in import StandInHub
from localdiff.cli import main
from localdiff.errors import HubError
from localdiff.hub import catalog, gguf_names
from localdiff.hub import models as hub
from hub_fixtures import cache  # noqa: F401  (the in-process cache fixture, pointed at our stand-in)

REPO = "acme/tiny-llada-GGUF"


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    import gguf_models as gm

    gm.need("gguf")  # a skip naming the extra; a failure under LOCALDIFF_REQUIRE_GGUF=1 (.ci/run)
    out = {}
    for q8 in (False, True):
        _, path = gm.write_both("llada", tmp_path_factory.mktemp("q8" if q8 else "f32"), q8=q8, seed=1)
        out["Q8_0" if q8 else "F32"] = path.read_bytes()
    return out


@pytest.fixture
def stand_in(gguf_files):
    with StandInHub() as h:
        h.add_repo(
            REPO,
            {
                "README.md": b"# tiny\n",
                "tiny-llada-F32.gguf": gguf_files["F32"],
                "tiny-llada-Q8_0.gguf": gguf_files["Q8_0"],
            },
        )
        h.repos[REPO].lfs_patterns = ("*.gguf",)
        yield h


def test_pull_one_quantization_then_list_and_show(cache, stand_in, capsys):  # noqa: F811
    res = hub.pull(f"{REPO}:q8_0", quiet=True)
    assert res["files"] == 1
    assert stand_in.stats.gets(REPO, "tiny-llada-F32.gguf") == []
    path = hub.resolve_model(f"{REPO}:Q8_0")
    assert path.name == "tiny-llada-Q8_0.gguf" and path.stat().st_size == len(
        stand_in.repos[REPO].commits[stand_in.repos[REPO].revisions["main"]]["tiny-llada-Q8_0.gguf"]
    )
    rows = [m for m in hub.list_models() if m["repo"] == REPO]
    assert [(m["name"], m["quant"], m["backend"]) for m in rows] == [(f"{REPO}:Q8_0", "Q8_0", "gguf")]
    assert main(["list"]) == 0
    listing = capsys.readouterr().out
    assert "BACKEND" in listing and f"{REPO}:Q8_0" in listing
    assert main(["show", f"{REPO}:Q8_0", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["summary"]
    assert shown["quant"] == "Q8_0" and shown["backend"].startswith("gguf") and shown["model_type"] == "llada"
    assert main(["pull", REPO, "--quant", "Q8_0", "-q"]) == 0  # up to date: nothing fetched
    assert len(stand_in.stats.gets(REPO, "tiny-llada-Q8_0.gguf")) == 1


def test_pull_resumes_a_cut_gguf_download(cache, stand_in):  # noqa: F811
    stand_in.cut_after[(REPO, "tiny-llada-F32.gguf")] = 100_000
    hub.pull(f"{REPO}:F32", quiet=True)
    assert stand_in.stats.gets(REPO, "tiny-llada-F32.gguf") == [None, "bytes=100000-"]
    assert hub.pull(f"{REPO}:F32", quiet=True, verify=True)["up_to_date"]


def test_a_missing_quantization_lists_the_ones_there(cache, stand_in, capsys):  # noqa: F811
    with pytest.raises(HubError) as e:
        hub.pull(f"{REPO}:Q4_K_M", quiet=True)
    assert "no Q4_K_M GGUF" in str(e.value) and "F32, Q8_0" in str(e.value)
    assert main(["pull", REPO, "--quant", "bogus"]) == 2
    assert "not a GGUF quantization label" in capsys.readouterr().err


def test_a_catalog_alias_with_a_quant_tag(cache, stand_in, monkeypatch):  # noqa: F811
    real = dict(catalog.load_catalog())
    real["tinyl:1m"] = catalog.CatalogEntry(alias="tinyl:1m", repo="acme/tiny-llada", gguf_repo=REPO)
    monkeypatch.setattr(catalog, "load_catalog", lambda root=None: real)
    t = hub.parse_name("tinyl:1m-q8_0")
    assert (t.repo, t.quant) == (REPO, "Q8_0")
    hub.pull("tinyl:1m-q8_0", quiet=True)
    assert [m["name"] for m in hub.list_models() if m["repo"] == REPO] == ["tinyl:1m-q8_0"]
    pytest.importorskip("llama_cpp")
    import localdiff

    m = localdiff.load("tinyl:1m-q8_0", threads=1)
    assert m.backend == "gguf" and m.quant == "Q8_0"
    assert len(m.generate([5, 6, 7], max_new_tokens=4, steps=4).token_ids) <= 4


def test_the_catalog_names_a_real_llada_gguf_repo():
    """``llada:8b-q4_k_m`` resolves (offline) to the public GGUF repo of LLaDA-8B-Instruct and its Q4_K_M file."""
    t = hub.parse_name("llada:8b-q4_k_m")
    assert (t.kind, t.repo, t.quant) == ("repo", "mradermacher/LLaDA-8B-Instruct-GGUF", "Q4_K_M")
    assert gguf_names.matches("LLaDA-8B-Instruct.Q4_K_M.gguf", t.quant)
    assert not gguf_names.matches("LLaDA-8B-Instruct.Q4_K_S.gguf", t.quant)


def test_rm_of_one_quantization_never_takes_the_others_with_it(cache, stand_in, capsys):  # noqa: F811
    """(rm REPO:Q8_0 deleted the whole snapshot: the F32 file pulled beside it too)"""
    hub.pull(f"{REPO}:Q8_0", quiet=True)
    hub.pull(f"{REPO}:F32", quiet=True)
    assert main(["rm", f"{REPO}:Q8_0"]) == 2
    assert capsys.readouterr().err == (
        f"error: {REPO}:Q8_0: {REPO} also holds tiny-llada-F32.gguf in the same "
        f"snapshot, and rm removes a whole snapshot; run `localdiff rm {REPO}` to "
        "remove every quantization in it\n"
    )
    assert hub.resolve_model(f"{REPO}:Q8_0").is_file() and hub.resolve_model(f"{REPO}:F32").is_file()
    assert main(["rm", REPO]) == 0 and not [m for m in hub.list_models() if m["repo"] == REPO]
    hub.pull(f"{REPO}:F32", quiet=True)
    assert main(["rm", f"{REPO}:F32"]) == 0  # the only quantization pulled: the snapshot is exactly it
    assert not [m for m in hub.list_models() if m["repo"] == REPO]
