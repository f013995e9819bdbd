"""Policy decision latency with the shipped default policy, against a plain-Python baseline.

Run: ``.venv/bin/python bench/policy.py [--iterations N] [--json]``

Rows (each cycles through the same mix of commands, timed one call at a time with
``perf_counter_ns`` after a warm-up):

- ``python rule function``: the default policy's logic hand-written in Python over contexts
  that are already normalized (the baseline, as in research/governance.md A.2).
- ``normalize``: ``normalize_operation`` alone (shell parsing, unwrapping, flag tables, paths).
- ``cedarpy, policy text parsed per call``: ``is_authorized`` given policy and schema text.
- ``cedarpy, parsed handles, full context``: PolicySet/Schema/Entities parsed once, every
  context attribute sent.
- ``CedarEngine.evaluate, no cache``: the engine (handles + only the attributes the policy
  reads + the decision mapping), cache off: the cost of a decision never seen before.
- ``CedarEngine.evaluate, cache``: the same with the per-unit answer cache warm.
- ``CedarEngine.evaluate, `ls -la```: one single-command request, cache off.
- ``normalize + decide``: what the gate spends per operation (sync core, and ``await decide``).
- ``builtin engine``: the pure-Python rule engine with the shipped rules.
- ``cedarpy floor``: a permit-all policy with an empty context: the fixed cost of one call.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import cedarpy

from sandlot.policy import PolicyRequest, Principal, Resource, normalize_operation
from sandlot.policy.builtin import BuiltinEngine
from sandlot.policy.cedar import DEFAULT_POLICY, SCHEMA, CedarEngine
from sandlot.policy.engine import decision_units

MIX: list[tuple[str, dict[str, object]]] = [
    ("exec", {"command": "ls -la"}),
    ("exec", {"command": "python3 -m pytest -q"}),
    ("exec", {"command": "git status"}),
    ("exec", {"command": "pip install requests"}),
    ("exec", {"command": "rm -rf /tmp/build"}),
    ("exec", {"command": "rm -rf /"}),
    ("exec", {"command": "/bin/rm --recursive --force /"}),
    ("exec", {"command": "bash -lc 'cd / && rm -rf .'"}),
    ("exec", {"command": "dd if=/dev/zero of=/dev/sda bs=1M"}),
    ("exec", {"command": "make 2>&1 | tee /tmp/log"}),
    ("exec", {"command": "curl -sSL https://example.com -o /tmp/page"}),
    ("exec", {"command": ["python3", "-c", "print(1)"]}),
    ("exec", {"command": "echo $HOME && ls ~"}),
    ("process.start", {"command": ["npm", "run", "dev"]}),
    ("fs.write", {"path": "/workspace/src/main.py"}),
    ("fs.read", {"path": "/etc/os-release"}),
]
PRINCIPAL = Principal(id="agent-1", tenant="acme")
SANDBOX = Resource(sandbox_id="sb-000000000001", tenant="acme", backend="local")

SYSTEM = frozenset(
    [
        "/",
        "/bin",
        "/boot",
        "/dev",
        "/etc",
        "/home",
        "/lib",
        "/lib32",
        "/lib64",
        "/libx32",
        "/media",
        "/mnt",
        "/opt",
        "/proc",
        "/root",
        "/run",
        "/sbin",
        "/srv",
        "/sys",
        "/usr",
        "/var",
        "/usr/bin",
        "/usr/lib",
        "/usr/lib64",
        "/usr/sbin",
        "/usr/share",
        "/usr/local",
        "/usr/include",
        "/var/lib",
    ]
)
RUN = frozenset({"exec", "process.start", "pty.open"})
WRITE = frozenset({"fs.write", "fs.mkdir", "fs.remove", "fs.chmod"})


def python_rules(action: str, workdir: str, units: list[dict]) -> bool:
    """The default policy's logic in plain Python (the baseline)."""
    if action in RUN:
        for u in units:
            program = u["program"]
            flags = u["flags"]
            paths = u["paths"]
            globs = u["glob_dirs"]
            if (
                program == "rm"
                and "recursive" in flags
                and (SYSTEM.intersection(paths) or SYSTEM.intersection(globs))
            ):
                return False
            if program == "rm" and "no_preserve_root" in flags:
                return False
            if program == "find" and "delete" in flags and SYSTEM.intersection(paths):
                return False
            if (
                program in ("chmod", "chown", "chgrp")
                and "recursive" in flags
                and SYSTEM.intersection(paths)
            ):
                return False
            if program == "mv" and SYSTEM.intersection(paths):
                return False
            if u["device_writes"]:
                return False
        return True
    if action in WRITE:
        within = units[0]["within"]
        if "/dev" in within and "/dev/shm" not in within:
            return False
        return workdir in within or bool(
            {"/tmp", "/var/tmp", "/root", "/home"}.intersection(within)
        )
    return True


def measure(fn: Callable[[int], object], iterations: int, warmup: int = 300) -> list[int]:
    for i in range(warmup):
        fn(i)
    out: list[int] = []
    clock = time.perf_counter_ns
    for i in range(iterations):
        t = clock()
        fn(i)
        out.append(clock() - t)
    return out


def stats(samples: list[int]) -> dict[str, float]:
    s = sorted(samples)
    return {
        "p50_us": s[len(s) // 2] / 1000,
        "p99_us": s[int(len(s) * 0.99)] / 1000,
        "mean_us": statistics.fmean(s) / 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=5000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    n = args.iterations

    requests: list[PolicyRequest] = [
        normalize_operation(a, principal=PRINCIPAL, resource=SANDBOX, args=kw) for a, kw in MIX
    ]
    units = [[ctx for _, ctx in decision_units(r)] for r in requests]
    k = len(requests)

    cedar = CedarEngine(DEFAULT_POLICY)
    uncached = CedarEngine(DEFAULT_POLICY, decision_cache_size=0)
    full = CedarEngine(DEFAULT_POLICY, schema=SCHEMA, decision_cache_size=0)  # no pruning
    builtin = BuiltinEngine.from_file("default")
    for r, u in zip(requests, units, strict=True):
        expected = python_rules(r.action, SANDBOX.workdir, u)
        for engine in (cedar, uncached, full, builtin):
            got = engine.evaluate(r).allowed
            assert got == expected, (r.context.get("raw"), engine.name, got, expected)

    # Raw cedarpy requests with every context attribute, for the parsed-per-call comparison.
    entities_json = [
        {
            "uid": {"type": "Agent", "id": PRINCIPAL.id},
            "attrs": {"tenant": PRINCIPAL.tenant, "roles": []},
            "parents": [{"type": "Tenant", "id": PRINCIPAL.tenant}],
        },
        {
            "uid": {"type": "Sandbox", "id": SANDBOX.sandbox_id},
            "attrs": {
                "tenant": SANDBOX.tenant,
                "backend": SANDBOX.backend,
                "owner": "",
                "workdir": SANDBOX.workdir,
            },
            "parents": [{"type": "Tenant", "id": SANDBOX.tenant}],
            "tags": {},
        },
    ]
    raw = [
        [
            {
                "principal": {"type": "Agent", "id": PRINCIPAL.id},
                "action": {"type": "Action", "id": r.action},
                "resource": {"type": "Sandbox", "id": SANDBOX.sandbox_id},
                "context": ctx,
            }
            for ctx in u
        ]
        for r, u in zip(requests, units, strict=True)
    ]
    policy_set = cedarpy.PolicySet.from_str(DEFAULT_POLICY)
    schema = cedarpy.Schema.from_str(SCHEMA)
    entities = cedarpy.Entities.from_json_str(json.dumps(entities_json), schema)
    floor_schema = cedarpy.Schema.from_str(
        'entity A; entity S; action "x" appliesTo { principal: [A], resource: [S], context: {} };'
    )
    floor_policy = cedarpy.PolicySet.from_str("permit (principal, action, resource);")
    floor_entities = cedarpy.Entities.from_json_str("[]")
    floor_request = [
        {
            "principal": {"type": "A", "id": "a"},
            "action": {"type": "Action", "id": "x"},
            "resource": {"type": "S", "id": "s"},
            "context": {},
        }
    ]

    loop = asyncio.new_event_loop()

    def decide_async(i: int) -> object:
        return loop.run_until_complete(uncached.decide(requests[i % k]))

    def normalize(i: int) -> PolicyRequest:
        a, kw = MIX[i % k]
        return normalize_operation(a, principal=PRINCIPAL, resource=SANDBOX, args=kw)

    rows: list[tuple[str, Callable[[int], object], int]] = [
        (
            "python rule function (baseline)",
            lambda i: python_rules(requests[i % k].action, "/workspace", units[i % k]),
            n,
        ),
        ("normalize_operation", normalize, n),
        (
            "cedarpy, policy text parsed per call",
            lambda i: cedarpy.is_authorized_batch(
                raw[i % k], DEFAULT_POLICY, entities_json, SCHEMA
            ),
            max(n // 10, 200),
        ),
        (
            "cedarpy, parsed handles, full context",
            lambda i: cedarpy.is_authorized_batch(raw[i % k], policy_set, entities, schema),
            n,
        ),
        ("CedarEngine.evaluate, full context", lambda i: full.evaluate(requests[i % k]), n),
        ("CedarEngine.evaluate, no cache", lambda i: uncached.evaluate(requests[i % k]), n),
        ("CedarEngine.evaluate, cache", lambda i: cedar.evaluate(requests[i % k]), n),
        ("CedarEngine.evaluate, `ls -la`, no cache", lambda i: uncached.evaluate(requests[0]), n),
        ("normalize + evaluate, no cache", lambda i: uncached.evaluate(normalize(i)), n),
        ("normalize + evaluate, cache", lambda i: cedar.evaluate(normalize(i)), n),
        ("await decide, no cache (event loop)", decide_async, n),
        ("builtin engine", lambda i: builtin.evaluate(requests[i % k]), n),
        (
            "cedarpy floor (permit-all, empty ctx)",
            lambda i: cedarpy.is_authorized_batch(
                floor_request, floor_policy, floor_entities, floor_schema
            ),
            n,
        ),
    ]
    load_before = f"{os.getloadavg()[0]:.2f}"
    results: dict[str, dict[str, float]] = {}
    for name, fn, iterations in rows:
        results[name] = stats(measure(fn, iterations))
    loop.close()

    base = results["python rule function (baseline)"]["p50_us"]
    if args.json:
        print(
            json.dumps(
                {"machine": platform.processor() or platform.machine(), "results": results},
                indent=2,
            )
        )
        return
    print(
        f"policy decision latency, {k} operations in the mix, {n} iterations, Python {platform.python_version()}"
    )
    print(
        f"load average before/after: {load_before} / {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)"
    )
    print(f"{'path':42} {'p50 µs':>9} {'p99 µs':>9} {'mean µs':>9} {'p50 / baseline':>15}")
    for name, r in results.items():
        print(
            f"{name:42} {r['p50_us']:9.1f} {r['p99_us']:9.1f} {r['mean_us']:9.1f} {r['p50_us'] / base:14.0f}x"
        )


if __name__ == "__main__":
    main()
