"""How the Manager talks to a running sandbox: the Channel protocol and the agent client."""
