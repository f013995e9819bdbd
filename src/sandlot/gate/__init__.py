"""The policy gate: decide, record, and only then run (see :mod:`sandlot.gate.gate`)."""
