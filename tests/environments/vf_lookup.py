"""A tool-using verifiers 0.4 environment, written as verifiers' docs write one (docs/v1/tasksets.md, "Adding
Tools", and the glossary example): a `vf.Toolset` with one `@vf.tool`, served once for the taskset over MCP
(`Taskset.toolsets`), and rewards for looking the fact up and repeating it. verifiers runs this module as the
tool server's program (`python -m tests.environments.vf_lookup`). Loaded by vime as
`--environment verifiers:tests.environments.vf_lookup`; imported only in the verifiers venv."""

from typing import Literal

import verifiers.v1 as vf

FACTS = {"ada": "first programmer", "grace": "compiler pioneer", "alan": "computability", "edsger": "shortest paths",
         "barbara": "abstract data types", "donald": "art of programming", "john": "lisp", "ken": "unix"}


class FactsToolset(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = "facts"

    @vf.tool
    async def lookup(self, name: Literal["ada", "grace", "alan", "edsger", "barbara", "donald", "john", "ken"]) -> str:
        """Look up what a person is known for."""
        return FACTS.get(str(name).strip().lower(), "no entry found")


class LookupData(vf.TaskData):
    answer: str


class LookupTask(vf.Task[LookupData]):
    @vf.reward(weight=0.5)
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(bool(trace.tool_messages))

    @vf.reward(weight=1.0)
    async def answered(self, trace: vf.Trace) -> float:
        return float(self.data.answer in trace.last_reply.lower())


class LookupConfig(vf.TasksetConfig):
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()


class LookupTaskset(vf.Taskset[LookupTask, LookupConfig]):
    @classmethod
    def toolsets(cls, config: LookupConfig) -> list[vf.Toolset]:
        return [FactsToolset(config.tools)]

    def load(self) -> list[LookupTask]:
        return [LookupTask(LookupData(idx=i, name=name.title(), answer=fact,
                                      prompt=f'Use the `facts_lookup` tool to look up "{name}", then reply with '
                                             "what it returns."), self.config.task)
                for i, (name, fact) in enumerate(FACTS.items())]


__all__ = ["LookupTaskset"]

if __name__ == "__main__":
    FactsToolset.run()
