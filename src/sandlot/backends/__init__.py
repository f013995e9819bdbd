"""sandlot.backends."""
