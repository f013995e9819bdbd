"""sandlot.channel."""
