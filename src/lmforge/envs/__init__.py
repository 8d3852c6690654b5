"""Multi-turn environments for RL: the environment API, tools called through the chat template, the
sandboxed Python tool (docs/environments.md).

This package sits beside ``checkpoint`` / ``evaluation`` in the layers: it may use rollout, data,
models and below; ``rl`` (the episode source) and ``serve`` (tool calls in chat completions) use it.
"""
