"""One source of truth for decoder options (#14): every option of every policy appears, from the schema, in
``gen --help`` / ``chat --help``, the environment variables, the config file, ``show`` and the chat's ``/set``; an
out-of-range value gives the same one-line message (after the name the user typed) from each source."""

from __future__ import annotations

import json

import pytest

import localdiff
from localdiff.cli import main
from localdiff.cli.dispatch import build_parser
from localdiff.config import load_user_config, sampler_overrides
from localdiff.decoding.options import POLICIES, all_specs
from localdiff.errors import UsageError
from localdiff.tui.settings import ChatSettings, apply_set_checked

SPECS = all_specs()


def _bad_value(spec):
    """A value outside the option's range (or of the wrong kind), as a string the user could type."""
    if spec.kind is bool or spec.choices:
        return "maybe"
    if spec.lo is not None:
        return str(spec.lo - 1)
    return "not-a-number"


def test_every_option_has_a_flag_in_gen_and_chat_help():
    p = build_parser()
    sub = next(a for a in p._actions if a.dest == "command").choices
    for cmd in ("gen", "chat"):
        text = sub[cmd].format_help()
        for spec in SPECS:
            assert spec.cli_flag in text and spec.env in text, (cmd, spec.name)


def test_every_option_is_read_from_env_and_config_file(tmp_path):
    for spec in SPECS:
        good = (
            "on"
            if spec.kind is bool
            else (spec.choices[0] if spec.choices else str(spec.default if spec.default is not None else spec.hi))
        )
        cfg = load_user_config(env={spec.env: good}, path=tmp_path / "none.toml")
        assert spec.name in cfg.sampler and cfg.origins[spec.name] == f"env:{spec.env}"
        f = tmp_path / f"{spec.name}.toml"
        f.write_text(f"[sampler]\n{spec.name} = {json.dumps(spec.coerce(good, 'x'))}\n".replace("null", '"none"'))
        cfg = load_user_config(env={}, path=f)
        assert spec.name in cfg.sampler and cfg.origins[spec.name] == "file"


def test_show_and_set_list_every_option_of_the_models_policy(capsys):
    assert main(["show", "tiny", "--json"]) == 0
    dec = json.loads(capsys.readouterr().out)["decoder"]
    cls = POLICIES[dec["policy"]]
    assert list(dec["options"]) == list(cls.names())
    m = localdiff.load("tiny")
    listing = apply_set_checked(ChatSettings(), "", m)
    for name in cls.names():
        assert f"{name}=" in listing


@pytest.mark.parametrize("spec", [s for s in SPECS if s.name in POLICIES["canvas_eb"].names()], ids=lambda s: s.name)
def test_out_of_range_value_gives_the_same_message_from_every_source(spec, tmp_path):
    bad = _bad_value(spec)
    m = localdiff.load("tiny")
    msgs = {}
    key = spec.cli_flag[2:].replace("-", "_")
    for where, call in {
        "flag": lambda: m.sampler_options(
            _typed={key: spec.cli_flag}, **sampler_overrides({key: bad}, load_user_config(env={}, path=tmp_path / "x"))
        ),
        "env": lambda: load_user_config(env={spec.env: bad}, path=tmp_path / "x"),
        "config": lambda: load_user_config(env={}, path=_write(tmp_path, spec.name, bad)),
        "/set": lambda: apply_set_checked(ChatSettings(), f"{spec.name} {bad}", m),
        "api": lambda: m.sampler_options(**{spec.name: bad}),
    }.items():
        with pytest.raises(UsageError) as e:
            call()
        msgs[where] = str(e.value)
    assert msgs["flag"].startswith(spec.cli_flag + ": ") and msgs["env"].startswith(spec.env + ": ")
    assert msgs["/set"].startswith(f"/set {spec.name}: ") and msgs["api"].startswith(f"{spec.name}: ")
    assert f"[sampler] {spec.name}: " in msgs["config"]
    bodies = {
        w: msg.split(": ", 1)[1] if w != "config" else msg.split(f"[sampler] {spec.name}: ", 1)[1]
        for w, msg in msgs.items()
    }
    assert len(set(bodies.values())) == 1, msgs
    assert bodies["api"].startswith("must be ") and f"(got {bad!r})" in bodies["api"]


@pytest.mark.parametrize("spec", [s for s in SPECS if s.optional and s.kind is not bool], ids=lambda s: s.name)
def test_an_empty_value_is_refused_not_read_as_off(spec):
    """(`--threshold ""` — an unset `"$TAU"` — silently turned locking off and exited 0; so did a request's
    `{"localdiff": {"threshold": ""}}`) "none" / "off" still turn an optional option off."""
    with pytest.raises(UsageError, match=r"\(got ''\)"):
        spec.coerce("", spec.cli_flag)
    with pytest.raises(UsageError):
        spec.coerce("  ", spec.cli_flag)
    assert spec.coerce("none", spec.cli_flag) is None and spec.coerce("OFF", spec.cli_flag) is None


def test_an_empty_flag_value_is_one_usage_line(capsys):
    assert main(["gen", "-p", "What is 1 + 1?", "--threshold", ""]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "error: --threshold: must be a number in (0, 1] (got '')\n"


def _write(tmp_path, name, bad):
    f = tmp_path / f"bad-{name}.toml"
    f.write_text(f'[sampler]\n{name} = "{bad}"\n')
    return f


def test_a_single_temperature_is_constant():
    """`--temperature T` (or a request's `temperature`) is a constant T, as README says: it set only the first
    step's temperature, so any T below the default t_min 0.4 was refused (the server's suggested 0.1 included)."""
    cls = POLICIES["canvas_eb"]
    o = cls.build({"t_min": 0.4, "t_max": 0.8, "temperature": "0.1"}, {"temperature": "--temperature"})
    assert (o.t_max, o.t_min) == (0.1, 0.1)
    o = cls.build({"t_max": "0.5:0.2"}, {"t_max": "--temperature"})
    assert (o.t_max, o.t_min) == (0.5, 0.2)
    o = cls.build({"t_max": "0.5", "t_min": "0.2"}, {"t_max": "--temperature", "t_min": "--t-min"})
    assert (o.t_max, o.t_min) == (0.5, 0.2)
    o = cls.build({"t_min": 0.4, "t_max": 0.8})  # checkpoint defaults: the schedule stays
    assert (o.t_max, o.t_min) == (0.8, 0.4)


def test_check_overrides_before_a_model_is_known():
    """chat / serve check their sampler flags at start (they were accepted and failed on every message/request)."""
    from localdiff.decoding.options import check_overrides

    check_overrides({"steps": "4", "temperature": "0.3", "threshold": "0.9", "max_new_tokens": 8})
    for bad, flag in (
        ({"steps": "0"}, "--steps"),
        ({"temperature": "1:2:3"}, "--temperature"),
        ({"entropy_bound": "-1"}, "--entropy-bound"),
        ({"threshold": "2"}, "--threshold"),
    ):
        with pytest.raises(UsageError, match=flag):
            check_overrides(bad, {k: flag for k in bad})
