"""Issue 40 item 5: ``pull`` checks the fit from the catalog (its stand-in config) before any network access and
refuses a model that fits this machine in no precision (``--force`` pulls anyway); it says which precision the fit
assumes. Issue 42 item 3: ``gen`` without ``--quant`` loads in the precision the plan picks and says so. The Hub is
the stand-in on 127.0.0.1; the machine (GPU memory, RAM) is fixed by monkeypatching."""

from __future__ import annotations

import json

import pytest

from hub_fixtures import point_hub_at
from hub_stand_in import StandInHub, tiny_checkpoint_files

import localdiff.hub.fit as machine
from localdiff.errors import HubError
from localdiff.hub import catalog
from localdiff.hub import models as hub

GIB = 1 << 30
MINI_REPO = catalog.lookup("llada2:mini").repo


def _machine(monkeypatch, ram_gib: float, gpu_gib: float = 0) -> None:
    monkeypatch.setattr(machine, "ram_bytes", lambda: int(ram_gib * GIB))
    monkeypatch.setattr(machine, "gpu_mem_bytes", lambda: int(gpu_gib * GIB))


@pytest.fixture
def stand_in():
    with StandInHub() as h:
        h.add_as_catalog(MINI_REPO, tiny_checkpoint_files(seed=3))
        mini = json.loads(catalog.lookup("llada2:mini").offline_config.read_text()).copy()
        h.add_repo("acme/big-moe", dict(tiny_checkpoint_files(seed=4), **{"config.json": json.dumps(mini).encode()}))
        yield h


@pytest.fixture
def cache(tmp_path, stand_in, monkeypatch):
    return point_hub_at(stand_in, tmp_path, monkeypatch)


def test_a_pull_that_cannot_fit_is_refused_before_any_request(cache, stand_in, monkeypatch, capsys):
    from localdiff.cli import main

    _machine(monkeypatch, 8)
    with pytest.raises(HubError) as e:
        hub.pull("llada2:mini", quiet=True)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(
        "llada2:mini cannot run on this machine: it needs about 11.66 GiB of "
        "RAM in int4, the smallest precision localdiff offers"
    )
    assert "8.00 GiB of RAM and no GPU" in msg and "pass --force" in msg
    assert stand_in.stats.requests == []  # not even the revision info
    assert not (cache / ("models--" + MINI_REPO.replace("/", "--"))).exists()
    assert main(["pull", "llada2:mini"]) == 1  # the CLI: one line, exit 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot run on this machine" in err and "Traceback" not in err
    assert stand_in.stats.requests == []


def test_with_a_gpu_too_small_and_little_ram_it_is_refused(cache, stand_in, monkeypatch):
    _machine(monkeypatch, 4, gpu_gib=6)
    with pytest.raises(HubError, match=r"no precision fits this 6\.00 GiB GPU"):
        hub.pull("llada2:mini", quiet=True)
    assert stand_in.stats.requests == []


def test_offline_the_fit_refusal_comes_before_the_network_error(cache, stand_in, monkeypatch):
    _machine(monkeypatch, 8)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubError, match="cannot run on this machine"):
        hub.pull("llada2:mini", quiet=True)
    _machine(monkeypatch, 64)  # it fits: now the offline error
    with pytest.raises(HubError, match=r"offline mode \(HF_HUB_OFFLINE=1\)"):
        hub.pull("llada2:mini", quiet=True)


def test_force_pulls_anyway(cache, stand_in, monkeypatch, capsys):
    from localdiff.cli import main

    _machine(monkeypatch, 8)
    assert main(["pull", "llada2:mini", "--force"]) == 0
    err = capsys.readouterr().err
    assert "warning: llada2:mini needs about 11.66 GiB of RAM in int4" in err and "pulling anyway (--force)" in err
    assert stand_in.stats.served(MINI_REPO, "model.safetensors") > 0
    assert hub.resolve_model("llada2:mini").is_dir()


def test_fits_only_in_a_lower_precision_is_said(cache, stand_in, monkeypatch, capsys):
    from localdiff.cli import main

    _machine(monkeypatch, 24)
    assert main(["pull", "llada2:mini"]) == 0
    err = capsys.readouterr().err
    assert "memory: llada2:mini fits 24.00 GiB of RAM in int8 on the CPU, not in bf16 (bf16 needs 32.55 GiB" in err
    assert "gen loads it in int8 when no --quant is given" in err
    _machine(monkeypatch, 64, gpu_gib=16)
    hub.remove("llada2:mini")
    assert main(["pull", "llada2:mini"]) == 0
    assert "fits this 16.00 GiB GPU in int4, everything on the GPU, not in bf16 or int8" in capsys.readouterr().err


def test_a_repo_outside_the_catalog_is_refused_after_its_config_before_the_weights(cache, stand_in, monkeypatch):
    _machine(monkeypatch, 8)
    with pytest.raises(HubError, match="acme/big-moe cannot run on this machine") as e:
        hub.pull("acme/big-moe", quiet=True)
    assert "only config.json was downloaded, not the weights (pass --force" in str(e.value)
    assert stand_in.stats.served("acme/big-moe", "config.json") > 0
    assert stand_in.stats.gets("acme/big-moe", "model.safetensors") == []
    res = hub.pull("acme/big-moe", quiet=True, force=True)
    assert res["files"] == 4 and stand_in.stats.served("acme/big-moe", "model.safetensors") > 0


def test_gen_without_quant_loads_in_the_chosen_precision_and_says_so(tmp_path, monkeypatch, capsys):
    """gen's choice, the loader monkeypatched (the int4 load lands from its own branch): a folder with LLaDA2-mini's
    config on a machine without a GPU."""
    from localdiff.cli import gen
    from localdiff.cli import main

    folder = tmp_path / "mini"
    folder.mkdir()
    (folder / "config.json").write_text(catalog.lookup("llada2:mini").offline_config.read_text())
    asked = []

    def fake_load(name, device, quant, *a, **k):
        asked.append(quant)
        raise KeyboardInterrupt  # stop here: the choice is what is tested

    monkeypatch.setattr(gen, "_load", fake_load)
    (tmp_path / "none.toml").touch()  # a LOCALDIFF_CONFIG file must exist
    monkeypatch.setenv("LOCALDIFF_CONFIG", str(tmp_path / "none.toml"))
    monkeypatch.delenv("LOCALDIFF_QUANT", raising=False)
    for ram, want, words in (
        (64, None, None),
        (24, "int8", "in int8 on the CPU, not in bf16"),
        (16, "int4", "in int4 on the CPU, not in bf16 or int8"),
        (8, "int4", "warning:"),
    ):
        _machine(monkeypatch, ram)
        main(["gen", "-m", str(folder), "--device", "cpu", "--dtype", "bfloat16", "-p", "hi"])
        err = capsys.readouterr().err
        assert asked[-1] == want, ram
        if words is None:
            assert "memory:" not in err and "warning:" not in err  # bf16 fits: the default, nothing said
        else:
            assert words in err and f"loading it in {want}" in err and "--quant chooses" in err
    main(["gen", "-m", str(folder), "--device", "cpu", "--quant", "int8", "-p", "hi"])  # asked: no choice made
    assert asked[-1] == "int8" and "memory:" not in capsys.readouterr().err
    monkeypatch.setenv("LOCALDIFF_QUANT", "none")
    main(["gen", "-m", str(folder), "--device", "cpu", "-p", "hi"])
    assert asked[-1] == "none"


def test_an_unknown_machine_is_never_refused(cache, stand_in, monkeypatch):
    """RAM that cannot be read and no GPU: nothing to judge, so the pull goes on (and gen loads as asked)."""
    _machine(monkeypatch, 0)
    res = hub.pull("llada2:mini", quiet=True)
    assert res["files"] == 4 and stand_in.stats.served(MINI_REPO, "model.safetensors") > 0
