"""A verifiers 0.4 environment whose reward function raises on odd tasks (the unit tests' malformed
environment): the sample of such a task fails, the others score."""

import verifiers.v1 as vf


class EchoTask(vf.Task[vf.TaskData]):
    @vf.stop
    async def single_turn(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward
    async def picky(self, trace: vf.Trace) -> float:
        if self.data.idx % 2:
            raise ValueError(f"task {self.data.idx} cannot be scored")
        return 1.0


class EchoTaskset(vf.Taskset[EchoTask, vf.TasksetConfig]):
    def load(self) -> list[EchoTask]:
        return [EchoTask(vf.TaskData(idx=i, prompt=f"Say {i}."), self.config.task) for i in range(4)]


__all__ = ["EchoTaskset"]
