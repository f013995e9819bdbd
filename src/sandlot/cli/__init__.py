"""The ``sandlot`` command line; ``main`` is the console script."""

from sandlot.cli.app import app, main

__all__ = ["app", "main"]
