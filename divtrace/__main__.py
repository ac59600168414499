"""``python -m divtrace``: the command line."""

from divtrace.cli import main

raise SystemExit(main())
