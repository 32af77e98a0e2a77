"""Agents: multi-turn tool-calling rollouts, tools, sandboxes.

Kept free of imports so that `vime.agents.<module>` loads only what it needs.
"""
