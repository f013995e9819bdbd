"""The OCI bundle a ``local`` sandbox boots from: its ``config.json`` and what it runs.

The container's init is the in-sandbox agent (:mod:`sandlot.channel.agent`), run by the host's
Python: from the host's ``/usr`` for a default root, or, in an image, with the host's loader
and libraries from ``/usr`` bound aside. The agent is bound in read-only, compiled once by that
interpreter. Beside it go the mounts of the runtime's socket directory (gVisor) and of the
``/etc/resolv.conf`` this backend rewrites (:mod:`.network`); :mod:`.oci` builds the rest of the
spec (namespaces, id mappings, cgroups, seccomp, masked paths). This module must not import the
store, the Manager or front ends.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from sandlot.backends.local import oci, protect
from sandlot.backends.local.ids import RANGE_SIZE
from sandlot.backends.local.network import (
    binds_resolv_conf,
    policy_kind,
    resolv_conf,
    set_resolv_conf,
)
from sandlot.backends.local.rootfs import HOSTNAME
from sandlot.backends.local.rootless import IdMap
from sandlot.backends.local.runtime import Crun
from sandlot.backends.local.state import LocalState, Meta, is_strict
from sandlot.errors import BackendUnavailable
from sandlot.models import SandboxSpec

if TYPE_CHECKING:
    from sandlot.network.service import SandboxNetwork


_AGENT_IN = "/.sandlot/agent.py"
_AGENT_PYC_IN = "/.sandlot/agent.pyc"
_HOST_USR_IN = "/.sandlot/usr"
_RUN_IN = "/.sandlot/run"
# runsc passes no file descriptors but stdio into a sandbox, so there the socket is bound inside,
# on a host directory mounted in (``--host-uds=create`` makes it a host socket), before the
# agent takes it over as fd 3. Binding in place, not bind-then-rename: gVisor forbids renaming
# or unlinking a host-backed socket from inside.
_GVISOR_BOOT = """\
import os, sys, _socket
s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
s.bind(sys.argv[1])
s.listen(128)
if s.fileno() != 3:
    os.dup2(s.fileno(), 3)
os.set_inheritable(3, True)
os.execv(sys.argv[2], sys.argv[2:])
"""


def _python_for_default_root() -> str:
    """The interpreter path inside a default-root sandbox (the host's, through ``/usr``)."""
    for cand in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(cand, os.X_OK):
            return cand
    msg = "the local backend needs a Python 3.8+ in /usr (Debian package python3-minimal)"
    raise BackendUnavailable(msg)


def _host_loader() -> tuple[str, str]:
    """The host's dynamic loader and library directory, relative to ``/usr``.

    Resolved on the host: the loader's usual path is an absolute symlink, which inside an
    image would point into the image, not into the host's ``/usr`` mounted beside it.
    """
    for loader in ("lib64/ld-linux-x86-64.so.2", "lib/ld-linux-aarch64.so.1"):
        real = Path("/usr", loader).resolve()
        if real.exists() and real.is_relative_to("/usr"):
            return str(real.relative_to("/usr")), str(real.parent.relative_to("/usr"))
    msg = "cannot find the host's dynamic loader under /usr to run the agent in an image"
    raise BackendUnavailable(msg)


class Bundle(LocalState):
    """Writing a sandbox's ``config.json`` (see the module docstring)."""

    def _bundle(self, d: Path, meta: Meta, spec: SandboxSpec, net: SandboxNetwork | None) -> object:
        """Write ``config.json``; the seccomp profile in it (for :meth:`Crun.learn_seccomp`)."""
        mounts: list[dict[str, object]] = [
            {
                "destination": _AGENT_IN,
                "type": "bind",
                "source": str(self._agent_copy),
                "options": ["bind", "ro", "nosuid", "nodev"],
            }
        ]
        if binds_resolv_conf(meta, net):
            # Bound read-only even under deny-all, so that a policy change at run time can
            # rewrite what the sandbox reads (see set_resolv_conf).
            kind = net.kind if net is not None else policy_kind(spec.network)
            resolv = d / "resolv.conf"
            set_resolv_conf(resolv, resolv_conf(kind, slirp=meta.idmap is not None))
            mounts.append(
                {
                    "destination": "/etc/resolv.conf",
                    "type": "bind",
                    "source": str(resolv),
                    "options": ["bind", "ro", "nosuid", "nodev", "noexec"],
                }
            )
        mode = ["--listen-fd", "3"]
        if meta.runtime == "runsc":
            mounts.append(
                {
                    "destination": _RUN_IN,
                    "type": "bind",
                    "source": str(self._mnt(meta.container) / "run"),
                    "options": ["bind", "rw", "nosuid", "nodev", "noexec"],
                }
            )
        host_python = Path(_python_for_default_root()).resolve()
        if meta.default_root and meta.idmap is not None:
            # Rootless: no id-mapped mount is possible, so the runtime binds the host's /usr
            # (its files show as owned by nobody inside); read-only down the whole tree.
            mounts.insert(
                0,
                {
                    "destination": "/usr",
                    "type": "bind",
                    "source": "/usr",
                    "options": ["rbind", "rro", "nosuid", "nodev"],
                },
            )
        if meta.default_root:
            python = [str(host_python)]
        else:
            # An image may have no Python, or another libc: run the host's interpreter with
            # the host's loader and libraries, from the host's /usr mounted aside.
            loader, libdir = _host_loader()
            mounts.append(
                {
                    "destination": _HOST_USR_IN,
                    "type": "bind",
                    "source": "/usr",
                    "options": ["rbind", "ro", "nosuid", "nodev"],
                }
            )
            python = [
                f"{_HOST_USR_IN}/{loader}",
                "--library-path",
                f"{_HOST_USR_IN}/{libdir}",
                f"{_HOST_USR_IN}/{host_python.relative_to('/usr')}",
            ]
        agent = _AGENT_IN
        pyc = self._compiled_agent(host_python)
        if pyc is not None:
            mounts.append(
                {
                    "destination": _AGENT_PYC_IN,
                    "type": "bind",
                    "source": str(pyc),
                    "options": ["bind", "ro", "nosuid", "nodev"],
                }
            )
            agent = _AGENT_PYC_IN
        args = [*python, "-I", "-S", agent, *mode, "--workdir", spec.workdir, "--quiet"]
        if meta.runtime == "runsc":
            args = [*python, "-I", "-S", "-c", _GVISOR_BOOT, f"{_RUN_IN}/agent.sock", *args]
        # The network's proxy variables are not in the init's environment, which every
        # command would inherit and no policy change could take back: the channel adds them
        # to each command it starts (see channel()).
        init_env = list(meta.image_env)
        uid_base, uid_size = meta.uid_base, RANGE_SIZE
        if meta.idmap is not None:
            # The runtime runs as root of the helper's user namespace, whose ids are the
            # sandbox's: the sandbox's own user namespace maps them one to one.
            uid_base, uid_size = 0, IdMap.from_json(meta.idmap).size
        cfg = oci.BundleConfig(
            args=args,
            rootfs=self._mnt(meta.container) / "rootfs",
            uid_base=uid_base,
            uid_size=uid_size,
            cgroups_path=self._cgroup_rel(meta.container),
            resources=spec.resources,
            env=init_env,
            extra_mounts=mounts,
            netns_path=net.netns_path if net is not None else None,
            hostname=HOSTNAME,
            gvisor=meta.runtime == "runsc",
            rootless=meta.idmap is not None,
            exec_listener=str(self._exec_listener(meta)) if is_strict(spec) else None,
        )
        doc = oci.build(cfg)
        protect.apply(doc, spec)
        linux = doc["linux"]
        profile = linux.get("seccomp") if isinstance(linux, dict) else None
        rt = self._runtimes[meta.runtime]
        if is_strict(spec):
            # The profile names this sandbox's listener: no compiled program to share, and
            # crun must load it itself to ask the kernel for a listener.
            profile = None
        if isinstance(rt, Crun) and profile is not None:
            annotations = rt.seccomp_annotation(profile)
            if annotations:
                doc["annotations"] = annotations
        tmp = d / ".config.json.tmp"
        tmp.write_text(json.dumps(doc))
        tmp.replace(d / "config.json")
        return profile

    def _compiled_agent(self, python: Path) -> Path | None:
        """The agent compiled by the sandboxes' interpreter, or None if that failed.

        A script run as ``__main__`` is compiled on every start and nothing can cache it from
        inside a read-only mount: for the agent that is most of its start-up time (about 35 ms
        of 55 here). Compiling once, with the very interpreter the sandboxes run, keeps the
        bytecode's magic number right.
        """
        if self._agent_pyc is not None or self._agent_pyc_failed:
            return self._agent_pyc
        target = self._agent_copy.with_name(
            f"{self._agent_copy.stem}-{hashlib.sha256(str(python).encode()).hexdigest()[:8]}.pyc"
        )
        if not target.exists():
            tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(3)}")
            code = (
                "import py_compile, sys; "
                "py_compile.compile(sys.argv[1], cfile=sys.argv[2], dfile=sys.argv[3], doraise=True)"
            )
            proc = subprocess.run(
                [str(python), "-I", "-S", "-c", code, str(self._agent_copy), str(tmp), _AGENT_IN],
                capture_output=True,
                check=False,
            )
            if proc.returncode != 0 or not tmp.exists():
                # Running the source works too, only slower to start.
                self._agent_pyc_failed = True
                return None
            tmp.chmod(0o644)
            tmp.replace(target)
        self._agent_pyc = target
        return target
