"""A tiny OpenEnv environment, written as OpenEnv's template writes one (Action / Observation models, an
`Environment` with reset and step, `create_app`): the episode asks for one digit (its reset seed mod 10); each step
rewards 1 when the model's message contains it (and ends the episode then), 0.5 when it holds another digit;
the episode ends after two steps at most.

Served by `uvicorn tests.environments.openenv_digits:app` (vime starts it for `--environment
openenv:tests.environments.openenv_digits`)."""

from __future__ import annotations

from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

MAX_STEPS = 2


def reward(target: int, message: str) -> float:
    """1 for the digit asked for, 0.5 for another digit (a signal an untrained model finds), else 0."""
    if str(target) in message:
        return 1.0
    return 0.5 if any(c.isdigit() for c in message) else 0.0


class DigitAction(Action):
    message: str = Field(..., description="The model's answer")


class DigitObservation(Observation):
    prompt: str = Field(default="", description="What the model is asked")


class DigitEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self):
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.target = 0

    def reset(self, seed: int | None = None) -> DigitObservation:
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.target = (seed or 0) % 10
        return DigitObservation(prompt=f"Say the digit {self.target}.", done=False, reward=None)

    def step(self, action: DigitAction) -> DigitObservation:
        self._state.step_count += 1
        if action.message.strip() == "raise":
            raise RuntimeError("the environment failed")
        hit = str(self.target) in action.message
        done = hit or self._state.step_count >= MAX_STEPS
        return DigitObservation(prompt=f"No. Say the digit {self.target}.", done=done, reward=reward(self.target,
                                                                                                    action.message))

    @property
    def state(self) -> State:
        return self._state


app = create_app(DigitEnvironment, DigitAction, DigitObservation, env_name="openenv_digits", max_concurrent_envs=64)
