"""The seccomp profile of local sandboxes, as the OCI ``linux.seccomp`` section.

Default-allow with an explicit deny list. The sandbox already runs as root of its own user
namespace with a reduced capability set, so most of these calls would fail on permissions
anyway; the profile is the second wall, and it closes the doors that permissions leave open to
an unprivileged process: new user namespaces (``unshare``/``clone`` with namespace flags, which
would hand the process a fresh set of capabilities to mount with), ``userfaultfd`` and
``io_uring`` (large kernel attack surfaces), ``perf_event_open``, ``bpf`` and the keyring.

Why default-allow rather than an allow list: the sandboxes run arbitrary programs from the
host's ``/usr`` or from user images, and an allow list that is short enough to review breaks
real software in ways that are hard to diagnose; the kernel calls that matter for escaping are
few and well known, and each is listed below. Denied calls fail with ``EPERM`` (the answer a
program gets when it lacks the privilege, which software handles), except ``clone3``: its flags
sit in a struct that seccomp cannot inspect, so it fails with ``ENOSYS`` and the C library falls
back to ``clone``, whose flags are checked. This module imports nothing from sandlot.
"""

from __future__ import annotations

import errno

__all__ = ["DENIED_SYSCALLS", "NAMESPACE_FLAGS", "profile"]

DENIED_SYSCALLS: tuple[str, ...] = (
    # mounting and pivoting: the sandbox's view of the filesystem is fixed from outside
    "mount",
    "umount",
    "umount2",
    "pivot_root",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    # namespaces: a new user namespace would grant a fresh capability set
    "unshare",
    "setns",
    # debugging other processes and reading their memory
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "process_madvise",
    "kcmp",
    "pidfd_getfd",
    # kernel code, kernel state and the machine
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "create_module",
    "get_kernel_syms",
    "query_module",
    "reboot",
    "swapon",
    "swapoff",
    "iopl",
    "ioperm",
    "syslog",
    "acct",
    "quotactl",
    "quotactl_fd",
    "nfsservctl",
    "_sysctl",
    "uselib",
    "ustat",
    "sysfs",
    "vm86",
    "vm86old",
    "lookup_dcookie",
    # time and names: never the host's, and not even the sandbox's own uts namespace
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "stime",
    "sethostname",
    "setdomainname",
    # large attack surfaces an agent's commands do not need
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "fanotify_init",
    "open_by_handle_at",
    "name_to_handle_at",
    # the kernel keyring is not namespaced
    "keyctl",
    "add_key",
    "request_key",
)

NAMESPACE_FLAGS: dict[str, int] = {
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}
"""The namespace bits of ``clone``'s flags (``CLONE_NEWTIME`` exists only for ``clone3`` and
``unshare``; in ``clone`` that bit belongs to the exit signal)."""


def profile(*, clone3: bool = True, listener_path: str | None = None) -> dict[str, object]:
    """The OCI seccomp section (x86-64 and its 32-bit compat ABIs).

    Args:
        clone3: answer ``clone3`` with ``ENOSYS``. runsc (2022-12) applies the profile in its
            own kernel, where that rule makes every ``posix_spawn`` fail with ``EPERM``
            instead of falling back to ``clone``; there, namespaces a process creates are
            the user-space kernel's anyway, and ``unshare``/``setns`` stay denied.
        listener_path: strict enforcement: ``execve`` and ``execveat`` stop in the kernel
            (``SCMP_ACT_NOTIFY``) and crun hands the filter's notify fd to the unix socket at
            this path (:mod:`.execgate` answers them).
    """
    # Names go in groups of 16: runsc builds a wrong filter from one long list (every
    # process spawn then fails), and the kernel's seccomp does not care.
    rules: list[dict[str, object]] = [
        {
            "names": list(DENIED_SYSCALLS[i : i + 16]),
            "action": "SCMP_ACT_ERRNO",
            "errnoRet": errno.EPERM,
        }
        for i in range(0, len(DENIED_SYSCALLS), 16)
    ]
    if clone3:
        rules.append({"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS})
    # One rule per flag: seccomp compares with a mask and an exact value, and separate rules
    # are OR-ed, so "any namespace flag set" is seven "this flag set" rules.
    rules.extend(
        {
            "names": ["clone"],
            "action": "SCMP_ACT_ERRNO",
            "errnoRet": errno.EPERM,
            "args": [{"index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}],
        }
        for flag in NAMESPACE_FLAGS.values()
    )
    doc: dict[str, object] = {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
        "syscalls": rules,
    }
    if listener_path is not None:
        rules.append({"names": ["execve", "execveat"], "action": "SCMP_ACT_NOTIFY"})
        doc["listenerPath"] = listener_path
    return doc
