"""``python -m sandlot`` runs the command line."""

from sandlot.cli import main

main()
