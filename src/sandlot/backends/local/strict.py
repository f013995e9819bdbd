"""Strict enforcement's hook in the ``local`` backend: every program a sandbox starts, decided.

A sandbox created with ``enforcement: strict`` boots with a seccomp profile that stops each
``execve`` in the kernel and hands crun's notify fd to a listener of ours (the OCI
``listenerPath``, :meth:`StrictEnforcement._exec_listener`). :class:`.execgate.ExecGate` reads
each call's path, argv and cwd and asks :attr:`~.state.LocalState.exec_decider` (the
Manager's gate) on the event loop the sandbox was booted from; the sandbox's own agent and
calls allowed before are let through without asking. With no decider every other program is
denied. This module must not import the store, the Manager or front ends.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import anyio
import anyio.from_thread
import anyio.lowlevel

from sandlot.backends.local.execgate import ExecCall, ExecGate
from sandlot.backends.local.state import LocalState, Meta


class StrictEnforcement(LocalState):
    """Opening and closing a strict sandbox's exec gate (see the module docstring)."""

    def _exec_listener(self, meta: Meta) -> Path:
        # sun_path holds 108 bytes: a short name under the run directory, not the state's.
        return self._run_root / "x" / f"{hashlib.sha256(meta.container.encode()).hexdigest()[:16]}"

    def _open_execgate(self, meta: Meta, d: Path) -> None:
        """Listen for crun's exec-notify fd (strict) and decide each program through
        :attr:`exec_decider`, on the event loop this runs on (an allowed call once per boot)."""
        self._close_execgate(meta.sandbox_id)
        path = self._exec_listener(meta)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        token = anyio.lowlevel.current_token()
        config = json.loads((d / "config.json").read_text())
        init = tuple(str(a) for a in config["process"]["args"])
        sandbox_id = meta.sandbox_id
        allowed: set[tuple[str, tuple[str, ...], str]] = set()

        def quick(call: ExecCall) -> bool | None:
            if call.path == init[0] and call.argv == init:
                return True  # the agent itself, as this backend wrote it into config.json
            # Only allows are kept: a repeated denial is decided (and receipted) again, so
            # every attempt shows in the log, and a policy change can still lift it.
            if (call.path, call.argv, call.cwd) in allowed:
                return True
            return None if self.exec_decider is not None else False

        def decide(call: ExecCall) -> bool:
            decider = self.exec_decider
            if decider is None or not anyio.from_thread.run(decider, sandbox_id, call, token=token):
                return False
            allowed.add((call.path, call.argv, call.cwd))
            return True

        # Decisions run on worker threads, several at once: one waiting for an approval
        # does not stop the sandbox's other programs.
        self._execgates[sandbox_id] = ExecGate(path, decide, quick=quick)

    def _close_execgate(self, sandbox_id: str) -> None:
        gate = self._execgates.pop(sandbox_id, None)
        if gate is not None:
            gate.close()
