"""The training group's and the rollout manager's verbs are declared once (`GROUP_CALLS`, `TRAINER_VERBS`,
`_fleet_verb`): each declaration names a method that exists on the side that runs it, so a rename there cannot
leave a verb that fails only when a run first calls it."""

from __future__ import annotations

import inspect

from vime.trainer.trainer import MegatronTrainer
from vime.ray import actor_group
from vime.ray.actor_group import GROUP_CALLS, TRAINER_VERBS, RayTrainGroup, TrainActor
from vime.ray.engine_fleet import EngineFleet
from vime.ray.rollout_manager import RolloutManager


def test_every_group_verb_runs_an_actor_method_and_every_trainer_verb_a_trainer_method():
    assert not [v for v in TRAINER_VERBS if not callable(getattr(MegatronTrainer, v, None))]
    assert not [v for v in GROUP_CALLS if not callable(getattr(TrainActor, v, None))]
    assert all(getattr(RayTrainGroup, v).__name__ == v for v in GROUP_CALLS)
    assert {spec.ranks for spec in GROUP_CALLS.values()} <= {"all", "first"}
    assert {spec.deadline for spec in GROUP_CALLS.values()} <= {"work", "control"}


def test_a_group_call_names_its_ranks_deadline_and_arguments_in_its_error(monkeypatch):
    class Ref:
        def __init__(self, verb, args):
            self.verb, self.args = verb, args

    class Actor:
        def __getattr__(self, verb):
            return type("Method", (), {"remote": staticmethod(lambda *a: Ref(verb, a))})

    seen = []
    monkeypatch.setattr(actor_group, "gather", lambda refs, what, timeout, flag: seen.append(
        (len(refs), what, timeout, flag)) or [{}, {"loss": 1.0}])
    monkeypatch.setattr(actor_group, "control", lambda refs, what: seen.append((len(refs), what)) or [None, None])
    group = RayTrainGroup.__new__(RayTrainGroup)
    group.actors, group.role = [Actor(), Actor()], "critic"
    group.args = type("Args", (), {"train_timeout": 30.0})()
    assert group.train(3, "handle") == {"loss": 1.0}  # the last pipeline stage's metrics
    assert group.publish_checkpoint(3, ["actor"]) == {}  # rank 0 alone
    assert group.set_plugin_values({"k": 1}) is None
    assert seen == [(2, "the critic ranks' training on rollout 3", 30.0, "--train-timeout"),
                    (1, "the critic ranks' publishing the checkpoint of rollout 3", 30.0, "--train-timeout"),
                    (2, "the critic ranks' plugin values")]


def test_the_rollout_managers_fleet_verbs_exist_on_the_fleet():
    verbs = {name: fn for name, fn in vars(RolloutManager.__ray_actor_class__).items()
             if inspect.isfunction(fn) and fn.__doc__ and fn.__doc__.startswith("`EngineFleet.")}
    assert len(verbs) == 11
    for fn in verbs.values():
        name = fn.__doc__.split("`")[1].split(".")[1]
        assert hasattr(EngineFleet, name), name
