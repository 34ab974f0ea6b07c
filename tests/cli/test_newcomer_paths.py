"""Command-line paths a first-time user hits: help written to a full device is an error (exit 1, one line);
``--dtype`` and ``LOCALDIFF_DTYPE`` accept and refuse the same names with the same message; an out-of-range
``--temperature`` is one usage error (never an empty answer or an internal error) while 0 and the bounds run; an empty
revision after ``@`` is a usage error; ``quantize -o`` into a folder that cannot be created names it before any
work."""

from __future__ import annotations

import errno
import io
import os

import pytest


from cli_fixtures import isolated  # noqa: F401  (fixture)
from localdiff.cli import main


class FullDevice(io.StringIO):
    """stdout on a full disk (``>/dev/full``): every flush fails with ENOSPC."""

    def flush(self):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize(
    "argv", [["--help"], ["gen", "--help"], ["list", "-h"], ["bench", "--help"]], ids=["top", "gen", "list", "bench"]
)
def test_help_on_a_full_device_is_an_error(argv, isolated, monkeypatch, capsys):
    """``localdiff --help >/dev/full`` (and every subcommand's help) exits 1 with the write error on stderr."""
    monkeypatch.setattr("sys.stdout", FullDevice())
    assert main(argv) == 1
    assert capsys.readouterr().err == "error: No space left on device\n"


@pytest.mark.parametrize("value", ["float16", " BFloat16 "])
def test_dtype_flag_and_env_take_the_same_names(value, isolated, monkeypatch):
    """``--dtype`` and ``LOCALDIFF_DTYPE`` take the same names, in any case and with spaces around, and ``load``
    runs in the dtype they name."""
    import localdiff
    from localdiff.cli.dispatch import build_parser

    args = build_parser().parse_args(["gen", "--dtype", value, "-p", "x"])
    monkeypatch.setenv("LOCALDIFF_DTYPE", value)
    assert str(localdiff.load("tiny", device="cpu").dtype) == "torch." + args.dtype == "torch." + value.strip().lower()


def test_dtype_flag_and_env_refuse_alike(isolated, monkeypatch, capsys):
    assert main(["gen", "--dtype", "fp8", "-p", "x"]) == 2
    flag_err = capsys.readouterr().err
    monkeypatch.setenv("LOCALDIFF_DTYPE", "fp8")
    assert main(["gen", "-p", "x"]) == 2
    env_err = capsys.readouterr().err
    assert flag_err == "error: --dtype='fp8': use one of float32, bfloat16, float16\n"
    assert env_err == "error: LOCALDIFF_DTYPE='fp8': use one of float32, bfloat16, float16 (or unset it)\n"


@pytest.mark.parametrize("value", ["1e308", "1e308:0.5", "0.5:1e308", "1e-40", "5e-324", "1e-320:0", "0.5:1e-9"])
def test_out_of_range_temperature_is_refused(value, isolated, capsys):
    """A temperature (or either end of a schedule) outside 0 or [0.001, 100] — huge, or so small the sampler's
    probabilities would overflow — is one ``--temperature`` usage error (exit 2), before any generation."""
    assert main(["gen", "-p", "hi", "-n", "4", "--temperature", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --temperature") and "0 or a number in [0.001, 100]" in err and err.count("\n") == 1


@pytest.mark.parametrize("value", ["0.001", "0.5:0", "100", "0.7:0.001"])
def test_temperature_zero_and_the_bounds_are_accepted(value, isolated, capsys):
    assert main(["gen", "-p", "What is 2 + 3?", "-n", "4", "--steps", "2", "--temperature", value]) == 0


@pytest.mark.parametrize("argv", [["pull", "org/repo@"], ["show", "org/repo@"]])
def test_empty_revision_is_a_usage_error(argv, isolated, capsys):
    """``pull`` / ``show org/repo@``: an empty revision after ``@`` is a usage error (exit 2) saying what to give."""
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "error: org/repo@: empty revision after '@' (give a branch, tag or commit hash, or drop the '@')\n"
    )


def test_quantize_to_an_uncreatable_folder_names_it(isolated, tmp_path, capsys):
    """``quantize -o DIR`` where DIR cannot be created (under a file; under ``/proc``) is a usage error naming it,
    given before the model is quantized; the file in the way is left as it was."""
    (tmp_path / "a-file").write_text("x")
    under_a_file = str(tmp_path / "a-file" / "x")  # uncreatable on every OS
    assert main(["quantize", "tiny", "-o", under_a_file]) == 2
    assert capsys.readouterr().err == f"error: -o {under_a_file}: cannot create the folder: Not a directory\n"
    assert (tmp_path / "a-file").read_text() == "x"
    if os.path.isdir("/proc/self"):  # the newcomer's case, where /proc exists (Linux)
        assert main(["quantize", "tiny", "-o", "/proc/x"]) == 2
        assert capsys.readouterr().err == "error: -o /proc/x: cannot create the folder: No such file or directory\n"
