"""Settings: ``sandlot.toml``, the environment and the flags, resolved into one value each.

:mod:`.schema` declares every setting and its default; :mod:`.load` resolves them with their
sources (flag > environment > file > default). Nothing here builds anything: the wiring
(:mod:`sandlot.wiring`) turns settings into a Manager. This package must not import the store,
the Manager, backends or any front end, so a command can read its settings cheaply.
"""

from sandlot.settings.load import CONFIG_FILE, ENVIRONMENT, Settings, load_settings
from sandlot.settings.schema import SettingsModel

__all__ = ["CONFIG_FILE", "ENVIRONMENT", "Settings", "SettingsModel", "load_settings"]
