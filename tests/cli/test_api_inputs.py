"""The Python API validates its arguments like the command line and raises localdiff's own errors (issue #22
item 11): bad max_new_tokens / seed / prompt shapes / messages give a UsageError with the CLI's message; numpy and
0-d tensor token ids are accepted as ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gen_checkpoint import shared_checkpoint

import localdiff
from localdiff.errors import LocaldiffError, UsageError

KW = {"max_denoising_steps": 2}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return localdiff.load(str(shared_checkpoint(tmp_path_factory)), device="cpu")


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"max_new_tokens": "abc"}, "max_new_tokens: invalid value 'abc' for 'max_new_tokens' (expected an integer)"),
        ({"max_new_tokens": 2.5}, "invalid value 2.5 for 'max_new_tokens'"),
        ({"max_new_tokens": True}, "invalid value True"),
        ({"max_new_tokens": 0}, "'max_new_tokens' must be a positive integer"),
        ({"seed": 2**70}, "'seed' must be in [0, 2**63)"),
        ({"seed": "abc"}, "seed: invalid value 'abc' for 'seed' (expected an integer)"),
        ({"seed": -1}, "'seed' must be in [0, 2**63) (got -1)"),
        ({"seed": 1.5}, "invalid value 1.5 for 'seed'"),
    ],
    ids=lambda v: repr(v)[:40],
)
def test_bad_generation_arguments_raise_usage_errors(model, kwargs, fragment):
    with pytest.raises(UsageError) as e:
        model.generate([5, 6, 7], **kwargs, **KW)
    assert fragment in str(e.value)


@pytest.mark.parametrize(
    "prompt,fragment",
    [
        (torch.zeros(1, 2, 3, dtype=torch.long), "[T] or [B, T] (got 3 dimensions)"),
        (torch.tensor(5), "(got 0 dimensions)"),
        (torch.ones(4), "integer token ids (got dtype torch.float32)"),
        (np.zeros((1, 1, 2), dtype=np.int64), "got 3 dimensions"),
        ([1, 2.5, 3], "token ids must be integers (got float 2.5)"),
        ([{"role": "user", "content": None}], "message 1: content must be a string (got NoneType)"),
        ([{"role": "wizard", "content": "hi"}], "message 1: unknown role 'wizard' (use system, user, assistant)"),
        ([{"role": "user", "content": "hi"}, "oops"], "message 2: expected a dict"),
        ({"role": "user"}, "unsupported prompt type dict"),
    ],
    ids=lambda v: repr(v)[:40],
)
def test_bad_prompts_raise_usage_errors(model, prompt, fragment):
    with pytest.raises(UsageError) as e:
        model.generate(prompt, max_new_tokens=4, seed=0, **KW)
    assert fragment in str(e.value)


def test_numpy_and_0d_tensor_ids_are_token_ids(model):
    want = model.generate([5, 6, 7], max_new_tokens=8, seed=1, **KW).token_ids
    assert model.generate(np.array([5, 6, 7]), max_new_tokens=8, seed=1, **KW).token_ids == want
    assert model.generate([np.int64(5), np.int32(6), np.uint8(7)], max_new_tokens=8, seed=1, **KW).token_ids == want
    assert (
        model.generate([torch.tensor(5), torch.tensor(6), torch.tensor(7)], max_new_tokens=8, seed=1, **KW).token_ids
        == want
    )
    assert model.generate([5, 6, 7], max_new_tokens=np.int64(8), seed=np.int64(1), **KW).token_ids == want


def test_api_and_cli_give_the_same_message(model, tmp_path, monkeypatch, capsys):
    from localdiff.cli import main

    (tmp_path / "c.toml").touch()  # LOCALDIFF_CONFIG names it: a missing named file is an error
    monkeypatch.setenv("LOCALDIFF_CONFIG", str(tmp_path / "c.toml"))
    assert main(["gen", "-m", str(model.path), "--seed", "-1", "-p", "x"]) == 2
    cli = capsys.readouterr().err.strip()
    with pytest.raises(LocaldiffError) as e:
        model.generate("x", seed=-1)
    assert cli.split(": ", 2)[-1] == str(e.value).split(": ", 1)[-1]  # "'seed' must be in [0, 2**63) (got -1)"
