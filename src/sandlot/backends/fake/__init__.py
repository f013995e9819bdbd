"""The ``fake`` backend: sandboxes in memory that record every call.

For users' own tests and for the Manager's unit tests (like httpx's MockTransport): no
isolation, no processes. Commands are answered by an ``exec_handler`` the test supplies (a
handful of built-ins otherwise: ``echo``, ``true``, ``false``, ``cat``, ``exit N``, ``sleep``,
``sh -c`` of those), files live in a dict, and a test can simulate what real runtimes do behind
our back: a stop, a vanished sandbox, an OOM, main-process output, a failing call.

Background processes of the built-ins behave like the real thing in miniature: ``echo`` prints
and exits, ``sleep N`` runs for N seconds, ``cat`` echoes its stdin until it is closed; any
other program runs until signalled (a test adds its output with ``emit_process_output`` and ends
it with ``finish_process``). Terminals echo what is typed, answer ``stty size`` and end on
``exit [N]``.

With ``state_file`` the sandboxes persist in a JSON file, so the CLI (one process per command)
can be tried on the fake backend.

Re-exports only. The modules, each importing only those listed before it:

- :mod:`.sandbox`: what a fake sandbox holds (:class:`FakeSandbox`, its JSON form for the state
  file) and what a test sees of the calls (:class:`FakeCall`, :class:`FakeExec`).
- :mod:`.programs`: what runs inside one: the built-in commands and the toy terminal.
- :mod:`.channel`: :class:`FakeChannel`, the fake's
  :class:`~sandlot.channel.base.Channel` (commands, processes, terminals, files); it reaches
  its backend's sandboxes through the backend (imported for types only).
- :mod:`.backend`: :class:`FakeBackend`, the Backend protocol in memory, the state file and
  the hooks tests use to act behind the Manager's back.

No module here imports the store, the Manager or a front end.
"""

from __future__ import annotations

from sandlot.backends.fake.backend import FakeBackend
from sandlot.backends.fake.channel import FakeChannel
from sandlot.backends.fake.sandbox import ExecHandler, FakeCall, FakeExec, FakeSandbox

__all__ = ["ExecHandler", "FakeBackend", "FakeCall", "FakeChannel", "FakeExec", "FakeSandbox"]
