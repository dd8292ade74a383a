"""shoal on Ray Serve (`pip install 'shoal[cluster]'`): an OpenAI + Anthropic ingress in front of
N engine replicas, session-affine routing through Ray Serve's `RequestRouter` API, and session
KV shared between replicas through the session tier (`shoal.engine.session_tier`).

The only part of shoal that imports ray; `routing` (the decisions) and `cli` (the commands'
arguments) do not, so `shoal --help` and the routing tests need no Ray.
"""
