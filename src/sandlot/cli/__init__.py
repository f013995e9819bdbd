"""The ``sandlot`` command line; ``main`` is the console script.

``sandlot --version`` is answered here, before typer or any other part of sandlot is
imported: those imports are most of the CLI's start-up, and a version check is what scripts
and installers run most. Everything else goes to :mod:`sandlot.cli.app` (the typer ``app``),
which registers every command when imported. This package must not import backends (the SDK
builds them).
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main() -> None:
    """The console script entry point."""
    # Exactly `sandlot --version`: with anything else on the line typer must parse it (a
    # usage error there is an error even beside --version).
    if sys.argv[1:] == ["--version"]:
        from sandlot._version import __version__

        print(f"sandlot {__version__}")
        return
    from sandlot.cli.app import main as run

    run()
