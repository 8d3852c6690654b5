"""Multi-turn environments for RL: the environment API, tools called through the chat template, the
sandboxed Python tool (docs/environments.md).

This package sits beside ``antidistill``, above ``rollout | runtime`` in the layers: it may use rollout,
runtime, data, quantize, losses, model, parallel and core; ``rl`` (the episode source) and ``serve`` (tool
calls in chat completions) use it.
"""
