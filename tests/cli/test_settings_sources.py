"""Settings from the environment and the config file are read as their flags are, and their errors name where
they came from (hardening pass 5)."""

from __future__ import annotations

import json

import pytest
from cli_fixtures import clear_user_settings

from localdiff.cli import main
from localdiff.config import load_user_config
from localdiff.errors import UsageError


def _sampler_used(capsys) -> dict:
    return json.loads(capsys.readouterr().out)["sampler"]


@pytest.mark.parametrize("source", ["env", "file"])
def test_temperature_pair_is_accepted_from_env_and_config_as_from_the_flag(source, tmp_path, monkeypatch, capsys):
    cfg = clear_user_settings(tmp_path, monkeypatch) / "config.toml"
    if source == "env":
        monkeypatch.setenv("LOCALDIFF_TEMPERATURE", "1:0.5")
    else:
        cfg.write_text('[sampler]\ntemperature = "1:0.5"\n')
    assert load_user_config().sampler["temperature"] == "1:0.5"
    argv = ["gen", "-p", "hi", "--json", "-q", "--seed", "0", "--max-new-tokens", "4"]
    assert main(argv) == 0
    env_used = _sampler_used(capsys)
    monkeypatch.delenv("LOCALDIFF_TEMPERATURE", raising=False)
    cfg.write_text("")
    assert main([*argv, "--temperature", "1:0.5"]) == 0
    flag_used = _sampler_used(capsys)
    assert env_used["t_max"] == flag_used["t_max"] == 1.0 and env_used["t_min"] == flag_used["t_min"] == 0.5


@pytest.mark.parametrize("value", ["1:x", "abc", "1:0.5:0.2", ":"])
def test_a_bad_temperature_from_env_is_still_refused_naming_the_variable(value, tmp_path, monkeypatch):
    clear_user_settings(tmp_path, monkeypatch)
    monkeypatch.setenv("LOCALDIFF_TEMPERATURE", value)
    with pytest.raises(UsageError, match="^LOCALDIFF_TEMPERATURE: "):
        load_user_config()


@pytest.mark.parametrize(
    "var, value",
    [("LOCALDIFF_CUDA_INT4", "foo"), ("LOCALDIFF_NO_BNB", "2"), ("LOCALDIFF_NO_BNB", "maybe")],
)
def test_cuda_int4_and_no_bnb_values_are_checked_on_every_machine(var, value, tmp_path, monkeypatch):
    """As LOCALDIFF_NATIVE_INT8=maybe is: refused at start, even on a CPU that never reads them."""
    from localdiff.config import check_environment

    with pytest.raises(UsageError, match=f"^{var}='{value}': use one of "):
        check_environment({var: value})


@pytest.mark.parametrize(
    "var, value",
    [
        ("LOCALDIFF_CUDA_INT4", "bnb"),
        ("LOCALDIFF_CUDA_INT4", "Auto"),
        ("LOCALDIFF_NO_BNB", "1"),
        ("LOCALDIFF_NO_BNB", "0"),
    ],
)
def test_the_values_the_code_reads_are_accepted(var, value):
    from localdiff.config import check_environment
    from localdiff.quantize.cuda4 import BACKENDS

    check_environment({var: value})
    assert set(BACKENDS) | {"auto"} == {"auto", "tinygemm", "bnb", "dequant"}  # the list in config._ENV_CHOICES


@pytest.mark.parametrize("value", ['""', '"  "'])
def test_an_empty_default_model_in_the_config_names_the_file(value, tmp_path, monkeypatch, capsys):
    cfg = clear_user_settings(tmp_path, monkeypatch) / "config.toml"
    cfg.write_text(f"default_model = {value}\n")
    assert main(["gen", "-p", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {cfg}: default_model: empty model name") and "\n" not in err, err


def test_a_blank_localdiff_model_names_the_variable(tmp_path, monkeypatch):
    clear_user_settings(tmp_path, monkeypatch)
    monkeypatch.setenv("LOCALDIFF_MODEL", "  ")
    with pytest.raises(UsageError, match="^LOCALDIFF_MODEL: empty model name"):
        load_user_config()
