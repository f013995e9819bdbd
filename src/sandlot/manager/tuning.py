"""The Manager's tunable numbers (times and sizes), in one place.

The rooms read them as ``tuning.NAME`` when they run (never ``from … import NAME``), so a test
(or an embedding program) that sets one here changes what every room does. Imports nothing.
"""

from __future__ import annotations

RECENT = 1.0
"""Seconds a record this process just read or wrote may stand in for a read on the hot path
(while its channel is open, which is the stronger sign the sandbox still runs)."""
RECENT_MAX = 4096
"""Records kept for the hot path before those older than :data:`RECENT` are forgotten."""
TOUCH_EVERY = 1.0
"""Activity is written at most this often per sandbox (idle timeouts are far coarser)."""
LAST_LINES = 20
"""How many lines of output a death certificate keeps."""
FAILED_KEEP = 3600.0
"""Seconds a failed creation is kept for inspection (its backend sandbox stopped) before the
sweep destroys it, unless the sandbox's own time to live ends sooner."""
SWEEP_BOUND = 30.0
"""Seconds an embedded caller's inline sweep may take at most (the rest waits for the next)."""
