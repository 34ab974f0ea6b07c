"""README facts a new user relies on (issue #22 item 13): the clone-and-cd step before the two commands, which stay
as they are; test duration; exit code 141; stdin; batch draw order; and the flags it names exist."""

from __future__ import annotations

import re
from pathlib import Path

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
RUN = 'pip install torch==2.13.0 && pip install . && localdiff gen -p "What is 27 + 58?"'
TEST = 'pip install torch==2.13.0 && pip install ".[test]" && python -m pytest -q'


def test_clone_and_cd_come_before_the_two_unchanged_commands():
    clone = README.find("git clone")
    assert clone != -1 and "cd localdiff" in README[clone : clone + 80]
    assert clone < README.find(RUN) < README.find(TEST)


def test_the_venv_and_cpu_wheel_hints_come_before_the_first_command():
    """(newcomer check, round 3: they came after both commands, so a reader who runs the first command as written
    on a CPU-only Linux machine had downloaded the several-GB CUDA wheel into the system Python before reading them)"""
    first = README.find(RUN)
    assert -1 < README.find("python -m venv .venv") < first
    assert -1 < README.find("--index-url https://download.pytorch.org/whl/cpu") < first


def test_readme_states_duration_exit_141_stdin_and_batch_order():
    assert re.search(r"takes about \d+ minutes", README)
    assert "141" in README and "</dev/null" in README and "draw order" in README
    assert "a row's tokens can change with the other prompts in its batch" in README


def test_flags_named_in_the_readme_exist():
    from localdiff.cli.dispatch import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices
    for cmd, flag in (
        ("gen", "--raw-bytes"),
        ("pull", "--no-space-check"),
        ("pull", "--verify"),
        ("quantize", "--force"),
    ):
        assert flag in README and flag in sub[cmd]._option_string_actions, (cmd, flag)


def test_readme_lists_every_config_key_env_variable_and_decoder_option():
    """README's Configuration section is the user's reference: every config-file key, every LOCALDIFF_* variable the
    code reads and every decoder option name appear in it (issue #41 item 9)."""
    from localdiff import config
    from localdiff.decoding.options import all_specs

    conf = README[README.index("## Configuration") :]
    for key in config._TOP_KEYS:
        assert f"`{key}`" in conf, key
    for name in list(config._ENV_TOP) + list(config._ENV_OTHER):
        assert name in conf, name
    for spec in all_specs():
        assert f"`{spec.name}`" in conf, spec.name


def test_readme_stays_short_and_its_documents_exist():
    assert README.count("\n") < 300
    root = Path(__file__).resolve().parents[2]
    for doc in re.findall(r"`(docs/[A-Z_]+\.md)`", README):
        assert (root / doc).is_file(), doc
