"""A verifiers 0.4 environment whose tool tells what a program verifiers launches during an episode inherits: its
toolset is the task's (`Task.toolsets`), so verifiers starts its tool server once per episode, in the `subprocess`
runtime, while the episode runs. The tool answers with every environment variable whose value looks like a relay
key (32 hex digits), or "none". Loaded by vime as `--environment verifiers:tests.environments.vf_environ`; imported
only in the verifiers venv."""

import os
import re

import verifiers.v1 as vf


class EnvironToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "facts"  # the tool the scripted engine of tests/environments/test_verifiers.py calls

    @vf.tool
    async def lookup(self, name: str) -> str:
        """Look up a name."""
        found = sorted(f"{key}={value}" for key, value in os.environ.items() if re.fullmatch(r"[0-9a-f]{32}", value))
        return " ".join(found) or "none"


class EnvironData(vf.TaskData):
    answer: str


class EnvironTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class EnvironTask(vf.Task[EnvironData, vf.State, EnvironTaskConfig]):
    @classmethod
    def toolsets(cls, config: EnvironTaskConfig) -> list[vf.Toolset]:  # task-scoped: one server per episode
        return [EnvironToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(bool(trace.tool_messages))


class EnvironConfig(vf.TasksetConfig):
    task: EnvironTaskConfig = EnvironTaskConfig()


class EnvironTaskset(vf.Taskset[EnvironTask, EnvironConfig]):
    def load(self) -> list[EnvironTask]:
        return [EnvironTask(EnvironData(idx=i, answer="none", prompt="Use the `facts_lookup` tool on \"ada\"."),
                            self.config.task)
                for i in range(4)]


__all__ = ["EnvironTaskset"]

if __name__ == "__main__":
    EnvironToolset.run()
