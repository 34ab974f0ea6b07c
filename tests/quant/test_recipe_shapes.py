"""A recipe table (a TOML file, or the copy a pre-quantized checkpoint records) of the wrong shape is one line
naming its source: ``rules = 5`` / ``plans = 5`` / ``models = 5`` and ``host_expert_layers = "abc"`` / ``inf``,
``gpu_mem = nan`` ended in ``internal error: TypeError / ValueError / OverflowError``; a misspelt key
(``int8_activation``) silently dropped the opt-in."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from localdiff.quantize.recipe import Recipe, RecipeError

SRC = Path("my-recipe.toml")


@pytest.mark.parametrize(
    "data, says",
    [
        ({"rules": 5}, "rules must be a list"),
        ({"plans": 5}, "plans must be a list"),
        ({"models": 5}, "models must be a list"),
        ({"plans": [{"gpu_mem": "2GiB", "host_expert_layers": "abc"}]}, "malformed recipe"),
        ({"plans": [{"gpu_mem": "2GiB", "host_expert_layers": math.inf}]}, "malformed recipe"),
        ({"plans": [{"gpu_mem": math.nan}]}, "not a size"),
        ({"int8_activation": "int8"}, "unknown recipe key 'int8_activation' (did you mean 'int8_activations'?)"),
    ],
)
def test_a_recipe_of_the_wrong_shape_is_one_line_naming_its_source(data, says):
    with pytest.raises(RecipeError) as e:
        Recipe.from_dict(data, source=SRC)
    msg = str(e.value)
    assert msg.startswith("my-recipe.toml: ") and says in msg and "\n" not in msg, msg


def test_every_recorded_recipe_reads_back():
    r = Recipe.from_dict({"rules": [["*proj", "int8"]], "int8_activations": "int8", "plans": [{"gpu_mem": "4GiB"}]})
    assert Recipe.from_dict(r.to_dict()) == Recipe.from_dict(r.to_dict())
    assert Recipe.from_dict(r.to_dict()).int8_activations == "int8"
