"""`localdiff bench`: every count flag checked before any section runs or any model loads."""

import pytest

from localdiff.bench import run as bench
from localdiff.errors import UsageError


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--reps", "-1"),
        ("--reps", "0"),
        ("--seeds", "-2"),
        ("--seeds", "0"),
        ("--per-family", "0"),
        ("--per-family", "-1"),
        ("--max-new-tokens", "0"),
        ("--max-new-tokens", "-1"),
        ("--random-steps", "0"),
        ("--batch-size", "0"),
        ("--history", "-5"),
        ("--history", "abc"),
        ("--history", "256,,1024"),
        ("--history", "0"),
        ("--history", "100000000"),
        ("--history", "9223372036854775808"),
        ("--history", "١٢"),
    ],
)
def test_count_flags_refused_before_anything_runs(flag, value, tmp_path):
    """A model that does not exist and an --out in a fresh folder: the count's error comes first, nothing created."""
    out = tmp_path / "new" / "r.json"
    argv = ["--quick", "--model", str(tmp_path / "nope"), "--out", str(out), flag, value]
    with pytest.raises(UsageError) as e:
        bench.main(argv)
    msg = str(e.value)
    assert msg.startswith(f"{flag}: must be") and "\n" not in msg and ("positive integer" in msg or "from 1 to" in msg)
    assert not out.parent.exists()


def test_good_history_is_normalised():
    args = bench.build_parser().parse_args(["--history", " 256, 1024"])
    bench.check_counts(args)
    assert args.history == "256,1024"
