"""The package version (read by hatchling and by ``sandlot --version``)."""

__version__ = "0.1.0"
