"""``python -m benchmarks SUITE [options]``: runs one suite (see :mod:`benchmarks`)."""

from __future__ import annotations

import importlib
import sys

SUITES = ("floor", "overhead", "sites", "parts", "ops", "lm", "backward", "tables")
#: Suites that live in another suite's module: (module, function).
_ENTRIES = {"parts": ("sites", "parts_main"), "ops": ("sites", "ops_main"),
            "floor": ("overhead", "floor_main")}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in SUITES:
        print(f"usage: python -m benchmarks {{{','.join(SUITES)}}} [options]\n"
              f"{importlib.import_module('benchmarks').__doc__}", file=sys.stderr)
        return 2
    name, entry = _ENTRIES.get(argv[0], (argv[0], "main"))
    suite = importlib.import_module(f"benchmarks.{name}")
    code: int = getattr(suite, entry)(argv[1:])
    return code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
