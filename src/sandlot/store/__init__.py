"""sandlot.store."""
