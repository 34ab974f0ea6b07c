"""Every attribute of a loaded ``Model`` exists once its constructor returns (issue #41 item 4): ``localdiff.load``,
the family runners and a generation add none later, so a reader finds them all in ``Model.__init__``."""

from __future__ import annotations

import pytest

import localdiff
from localdiff.engine import Model


@pytest.mark.parametrize("name", ["tiny", "tiny-mdm", "tiny-bd", "tiny-refusion", "tiny-qwen3"])
def test_load_and_generate_add_no_attribute(name, monkeypatch):
    built = []
    init = Model.__init__

    def recording(self, *a, **kw):
        init(self, *a, **kw)
        built.append(set(vars(self)))

    monkeypatch.setattr(Model, "__init__", recording)
    m = localdiff.load(name, device="cpu")
    m.generate("What is 41 + 93?", max_new_tokens=4, seed=0)
    assert built and set(vars(m)) == built[-1], sorted(set(vars(m)) ^ built[-1])
    assert m.backend == "torch" and m.backend_version is None and m.gpu_layers == 0 and m.draft is None
    assert (m.mask_token_id is None) == (m.family in ("canvas", "causal"))
    if m.mask_token_id is not None:
        assert m.mask_token_id == m.config.mask_token_id
