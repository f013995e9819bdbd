"""The ``sandlot`` command line; ``main`` is the console script.

The command groups register themselves on ``app`` when imported, here, so that ``app`` is
complete whichever way the CLI is entered.
"""

from sandlot.cli import config_cmds, governance, images, network, server_cmds, shell
from sandlot.cli.app import app, main

__all__ = ["app", "config_cmds", "governance", "images", "main", "network", "server_cmds", "shell"]
