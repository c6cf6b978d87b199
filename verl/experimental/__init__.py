"""verl's `verl.experimental` package path, kept so that verl 0.9.1 user code imports unchanged.

Owns nothing itself; `verl.experimental.agent_loop` holds verl's agent-loop API (for now its tool-call parsers).

Layer 1: imports nothing.
"""
