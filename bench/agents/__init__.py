"""Real coding-agent clients (Claude Code, Codex, aider, opencode) against `mlxserve serve`
and llama-server, every request recorded by a logging proxy (docs/agents.md).

Run: ``mlxserve bench agents`` or ``python -m bench.agents`` (``--help`` for the flags).
"""
