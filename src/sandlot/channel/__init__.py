"""How the Manager talks to a running sandbox: the Channel protocol and the agent client.

The modules, and what each may import besides the wire models and the errors (none of them
imports backends, the store or the Manager):

- :mod:`.base`: the :class:`~sandlot.channel.base.Channel` protocol every backend's channel
  implements. Nothing else of the channel.
- :mod:`.forward`: :class:`~sandlot.channel.forward.ForwardingChannel`, the base of the
  backends' own channels. Only :mod:`.base`.
- :mod:`.protocol`: the agent wire protocol's codec, constants and error codes (the host's
  copy; ``docs/agent-protocol.md`` is the specification). The standard library only.
- :mod:`.replies`: the agent's replies read into wire models, and the checks a request passes
  before it is sent. Only :mod:`.protocol`.
- :mod:`.connection`: framing, dispatch and per-stream flow control over one byte stream,
  shared by many requests without a reader task. Only :mod:`.protocol` and :mod:`.replies`.
- :mod:`.pty`: :class:`~sandlot.channel.pty.AgentPty`, a terminal on one stream of a
  connection. Only :mod:`.connection`, :mod:`.replies` and :mod:`.protocol`.
- :mod:`.client`: :class:`~sandlot.channel.client.AgentChannel`, every operation of the
  protocol, and ``connect_stream``/``connect_unix``; re-exports ``AgentPty``. The modules above.
- :mod:`.agent`: the program inside the sandbox. One stdlib-only file that imports nothing of
  sandlot (it is copied alone into images; changing it means rebuilding the guest image).
"""
