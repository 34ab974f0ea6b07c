"""Declarative decoder registration (issue #41 item 3): a decoder is one ``@decoder`` declaration next to its options
class, and every table is derived from the declarations; a decoder option is one field, seen by the CLI flags, the
environment, the config file, ``/set``, the server and ``show``; the ``decoder`` option picks the decoder explicitly.

The test-only decoder ``dummy_llada`` is LLaDA's options plus one field, declared for the masked family with LLaDA's
policy class: on the fake masked model it must give LLaDA's tokens (the declaration adds nothing but its name and
option), and it is undeclared after each test."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

from fake_masked import FakeMaskedConfig, FakeMaskedNet
from localdiff import config
from localdiff.arch import REGISTRY, ArchEntry
from localdiff.decoding import options as registry
from localdiff.decoding.defaults import describe
from localdiff.decoding.options import LLaDAOptions, decoder
from localdiff.decoding.schema import opt, undeclare
from localdiff.engine import Model
from localdiff.errors import UsageError

pytestmark = pytest.mark.usefixtures("one_thread")

EOS = 2


@pytest.fixture
def dummy():
    """Declare the test-only decoder (one declaration, one new field); undeclared afterwards."""

    @decoder(
        "dummy_llada", "masked", policy="localdiff.decoding.llada:LLaDA", model_types=("dummy_type",), selectable=True
    )
    @dataclass(frozen=True)
    class DummyOptions(LLaDAOptions):
        """LLaDA's options plus a test-only knob."""

        dummy_knob: int = opt(3, "a test-only option", lo=1, hi=9, metavar="N")

    yield DummyOptions
    undeclare("dummy_llada")


@pytest.fixture
def make(monkeypatch, tmp_path):
    def _make(gen_config=None, model_type=None):
        cfg = FakeMaskedConfig(eos_token_id=(EOS,), pad_token_id=0)
        if model_type:
            cfg = dataclasses.replace(cfg, model_type=model_type)
        monkeypatch.setitem(REGISTRY, cfg.model_type, ArchEntry("fake_masked", "fake_masked", "masked"))
        return Model(
            FakeMaskedNet(cfg, seed=3), cfg, None, tmp_path, "fake", "cpu", torch.float32, None, dict(gen_config or {})
        )

    return _make


def test_a_declaration_is_picked_up_by_every_table(dummy):
    assert registry.POLICIES["dummy_llada"] is dummy and dummy.POLICY == "dummy_llada"
    assert registry.DECODERS["dummy_llada"].family == "masked"
    assert registry.policy_for_family("masked", "Dummy_Type") == "dummy_llada"  # its model_type runs it
    assert registry.policy_for_family("masked", "llada") == "llada"  # the family default stays
    assert registry.runnable("masked", "llada") == ["llada", "nap", "dummy_llada"]  # selectable on the family
    assert "dummy_llada" not in registry.runnable("block", "sdar")
    from localdiff.decoding.llada import LLaDA

    assert registry.policy_classes("masked")["dummy_llada"] is LLaDA
    assert "dummy_llada" in registry.decoder_spec().choices
    undeclare("dummy_llada")
    assert "dummy_llada" not in registry.POLICIES and "dummy_llada" not in registry.runnable("masked", "llada")
    assert registry.policy_for_family("masked", "dummy_type") == "llada"


def test_a_name_declared_twice_is_refused(dummy):
    with pytest.raises(ValueError, match="declared twice"):
        decoder("llada", "masked")(dummy)


def test_a_new_field_is_a_flag_an_env_variable_a_config_key_a_set_word_a_server_field_and_shown(dummy, tmp_path, make):
    from localdiff.cli.dispatch import build_parser
    from localdiff.cli.gen import _flags
    from localdiff.serve.errors import ApiError
    from localdiff.serve.options import to_engine_options
    from localdiff.tui.settings import ChatSettings, apply_set_checked

    args = build_parser().parse_args(["gen", "-p", "x", "--decoder", "dummy_llada", "--dummy-knob", "5"])
    assert _flags(args) == {"decoder": "dummy_llada", "dummy_knob": "5"}
    assert "LOCALDIFF_DUMMY_KNOB" in config.known_environment()
    cfg = config.load_user_config(
        env={"LOCALDIFF_DUMMY_KNOB": "6", "LOCALDIFF_DECODER": "dummy_llada"}, path=tmp_path / "none.toml"
    )
    assert cfg.sampler["dummy_knob"] == 6 and cfg.sampler["decoder"] == "dummy_llada"
    with pytest.raises(UsageError, match=r"^LOCALDIFF_DUMMY_KNOB: must be an integer in \[1, 9\] \(got '10'\)"):
        config.load_user_config(env={"LOCALDIFF_DUMMY_KNOB": "10"}, path=tmp_path / "none.toml")
    (tmp_path / "c.toml").write_text('[sampler]\ndecoder = "dummy_llada"\ndummy_knob = 4\n')
    assert dict(config.load_user_config(env={}, path=tmp_path / "c.toml").sampler) == {
        "decoder": "dummy_llada",
        "dummy_knob": 4,
    }

    model, settings = make(), ChatSettings()
    apply_set_checked(settings, "decoder dummy_llada", model)
    assert apply_set_checked(settings, "dummy_knob 7", model) == "dummy_knob = 7"
    assert model.sampler_options(**settings.sampler)["dummy_knob"] == 7

    out = to_engine_options({"sampler": {"decoder": "dummy_llada", "dummy_knob": 2}})
    assert out["sampler"] == {"decoder": "dummy_llada", "dummy_knob": 2}
    with pytest.raises(ApiError, match="dummy_knob"):
        to_engine_options({"sampler": {"dummy_knob": 0}})

    (tmp_path / "generation_config.json").write_text('{"decoder": "dummy_llada", "dummy_knob": 8}')
    shown = describe("masked", tmp_path)
    assert shown["policy"] == "dummy_llada" and "dummy_llada" in shown["decoders"]
    assert shown["options"]["dummy_knob"] == {
        "value": 8,
        "flag": "--dummy-knob",
        "env": "LOCALDIFF_DUMMY_KNOB",
        "allowed": "an integer in [1, 9]",
        "help": "a test-only option",
        "from": "generation_config",
    }


def test_the_declared_decoder_runs_its_policy_class_with_its_options(dummy, make):
    model = make()
    ids = [[5, 6, 7, 8]]
    ref = model.generate(ids, max_new_tokens=8, seed=0, steps=4, block_length=4)
    got = model.generate(ids, max_new_tokens=8, seed=0, steps=4, block_length=4, decoder="dummy_llada", dummy_knob=2)
    assert got.token_ids == ref.token_ids and ref.sampler["decoder"] == "llada"
    assert got.sampler["decoder"] == "dummy_llada" and got.sampler["dummy_knob"] == 2
    with pytest.raises(UsageError, match=r"^dummy_knob: an option of the dummy_llada decoder.*decoder dummy_llada"):
        model.sampler_options(dummy_knob=2)
    typed = make(model_type="dummy_type")  # a model_type it declares runs it by default
    assert typed.sampler_options()["decoder"] == "dummy_llada"


def test_the_decoder_option_is_checked_everywhere_with_one_line(tmp_path, make):
    from localdiff.decoding.options import check_overrides

    with pytest.raises(UsageError, match=r"^--decoder: must be one of canvas_eb, llada, .* \(got 'fast'\)$"):
        check_overrides({"decoder": "fast"}, {"decoder": "--decoder"})
    with pytest.raises(
        UsageError,
        match=r"^/set decoder: this model runs the decoders llada, nap; sdar is a "
        r"block-family decoder \(got 'sdar'\)$",
    ):
        make().sampler_options(_typed={"decoder": "/set decoder"}, decoder="sdar")
    model = make()
    assert model.applicable({"decoder": "sdar", "steps": 3}) == {"steps": 3}  # a saved decoder it cannot run
    assert model.applicable({"decoder": "nap"}) == {"decoder": "nap"}
    assert model.applicable({"decoder": "sdar"}, keep=("decoder",)) == {"decoder": "sdar"}  # typed: checked
