"""A decoder given for this run (``--decoder`` or ``LOCALDIFF_DECODER``) that the model cannot run is an error naming
its source; one saved in the config file is for the models that can run it: skipped for the others with one note.
``serve``: refused at start when none of the offered models can run it (LOCALDIFF_DECODER=llada ran tiny's canvas_eb
with exit 0; ``serve -m tiny --decoder llada`` started)."""

from __future__ import annotations

import json

import pytest
from cli_fixtures import clear_user_settings

from localdiff.cli import main
from localdiff.serve.decoder_check import check_decoder
from localdiff.errors import UsageError

GEN = ["gen", "-p", "hi", "--json", "-q", "--seed", "0", "--max-new-tokens", "4"]
NOTE = "note: config decoder 'llada' does not apply to tiny (it runs canvas_eb); ignored"


@pytest.fixture
def config(tmp_path, monkeypatch):
    return clear_user_settings(tmp_path, monkeypatch) / "config.toml"


def _one_error(capsys) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("source", ["--decoder", "LOCALDIFF_DECODER"])
def test_a_decoder_for_this_run_the_model_cannot_run_is_an_error_naming_it(source, config, monkeypatch, capsys):
    if source == "--decoder":
        rc = main([*GEN, "--decoder", "llada"])
    else:
        monkeypatch.setenv("LOCALDIFF_DECODER", "llada")
        rc = main(GEN)
    assert rc == 2
    line = _one_error(capsys)
    assert line.startswith(f"error: {source}: this model runs the decoder canvas_eb; llada "), line


def test_a_config_decoder_for_other_models_is_skipped_with_one_note(config, capsys):
    config.write_text('[sampler]\ndecoder = "llada"\n')
    assert main(GEN) == 0
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == [NOTE]
    assert json.loads(out)["sampler"]["decoder"] == "canvas_eb"


def test_a_config_decoder_the_model_runs_is_used_without_a_note(config, capsys):
    config.write_text('[sampler]\ndecoder = "nap"\n')
    assert main([*GEN, "-m", "tiny-mdm"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and json.loads(out)["sampler"]["decoder"] == "nap"


@pytest.mark.parametrize("source", ["--decoder", "LOCALDIFF_DECODER"])
def test_serve_refuses_a_decoder_no_offered_model_runs(source, config, monkeypatch, capsys):
    import localdiff.serve

    def started(*a, **k):  # the server would start here: fail the test instead of serving
        raise AssertionError("serve went on to bind its port")

    monkeypatch.setattr(localdiff.serve, "check_port", started)
    argv = ["serve", "-m", "tiny", "--port", "18299"]
    if source == "--decoder":
        argv += ["--decoder", "llada"]
    else:
        monkeypatch.setenv("LOCALDIFF_DECODER", "llada")
    assert main(argv) == 2
    line = _one_error(capsys)
    assert line == f"error: {source}: none of the served models can run the decoder llada (tiny runs canvas_eb)"


def test_serve_decoder_check_passes_when_one_offered_model_runs_it():
    check_decoder("llada", ["tiny", "tiny-mdm"], "--decoder")
    check_decoder("llada", ["no-such-model-here"], "--decoder")  # cannot tell: its load reports it
    with pytest.raises(UsageError, match="tiny runs canvas_eb; tiny-bd runs "):
        check_decoder("llada", ["tiny", "tiny-bd"], "--decoder")
