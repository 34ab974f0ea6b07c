import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def ref_small(tmp_path_factory):
    """(reference model, checkpoint dir) of the 'small' random config, saved sharded."""
    from refmodels import build_reference, save_reference

    ref = build_reference("small", canvas_length=8)
    d = tmp_path_factory.mktemp("ck_small")
    save_reference(ref, d)
    return ref, d


@pytest.fixture(scope="session")
def ref_odd(tmp_path_factory):
    from refmodels import build_reference, save_reference

    ref = build_reference("odd", canvas_length=6, seed=3)
    d = tmp_path_factory.mktemp("ck_odd")
    save_reference(ref, d)
    return ref, d
