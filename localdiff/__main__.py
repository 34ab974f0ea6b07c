"""``python -m localdiff`` = the ``localdiff`` console script."""

from localdiff.cli import main

raise SystemExit(main())
