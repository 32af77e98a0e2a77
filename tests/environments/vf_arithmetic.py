"""A single-turn verifiers 0.4 environment, written as verifiers' docs write a taskset (docs/v1/tasksets.md: the
`AdditionTaskset`, with reverse-text's `@vf.stop` single turn): one addition question per task, three weighted
reward functions. Loaded by vime as `--environment verifiers:tests.environments.vf_arithmetic`; imported only in
the verifiers venv (vime's bridge process), never by vime."""

import verifiers.v1 as vf


class AdditionData(vf.TaskData):
    answer: int


class AdditionTask(vf.Task[AdditionData]):
    @vf.stop
    async def single_turn(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def exact_match(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == str(self.data.answer))

    @vf.reward(weight=0.5)
    async def has_digit(self, trace: vf.Trace) -> float:
        return float(any(c.isdigit() for c in trace.last_reply))

    @vf.reward(weight=0.1)  # a shaping term that tells apart any two replies of different lengths
    async def brevity(self, trace: vf.Trace) -> float:
        return 1.0 / (1.0 + len(trace.last_reply))

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class AdditionConfig(vf.TasksetConfig):
    num_tasks: int = 100


class AdditionTaskset(vf.Taskset[AdditionTask, AdditionConfig]):
    def load(self) -> list[AdditionTask]:
        return [AdditionTask(AdditionData(idx=i, prompt=f"What is {i} + {i}?", answer=2 * i), self.config.task)
                for i in range(self.config.num_tasks)]


__all__ = ["AdditionTaskset"]
