"""The training group's and the rollout manager's verbs are declared where they live, as methods with their
signatures (`group_call`, `trainer_verb`, `fleet_verb`), so go-to-definition finds them: each declaration names a
method that exists on the side that runs it, with the same parameters, so a rename or a changed signature there
cannot leave a verb that fails only when a run first calls it."""

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
    assert set(TRAINER_VERBS) == {"onload", "save", "save_hf", "get_loaded_state", "set_plugin_values",
                                  "compute_kind", "probe_log_probs"}
    assert {"train", "save", "publish_checkpoint", "probe_log_probs", "compute_kind"} <= set(GROUP_CALLS)
    for verb in TRAINER_VERBS:  # the declared parameters are the trainer's
        assert _parameters(getattr(TrainActor, verb)) == _parameters(getattr(MegatronTrainer, verb)), verb
    for verb in GROUP_CALLS:  # the group's are the actor's
        assert _parameters(getattr(RayTrainGroup, verb)) == _parameters(getattr(TrainActor, verb)), verb
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


def _parameters(fn) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self" and not p.startswith("_ray")]  # Ray's own


def test_the_rollout_managers_fleet_verbs_exist_on_the_fleet():
    verbs = {name: fn for name, fn in vars(RolloutManager.__ray_actor_class__).items()
             if inspect.isfunction(fn) and getattr(fn, "fleet_verb", None)}
    assert len(verbs) == 11
    for fn in verbs.values():
        target = inspect.getattr_static(EngineFleet, fn.fleet_verb, None)
        assert target is not None, fn.fleet_verb
        if inspect.isfunction(target):  # a method: the same parameters
            assert _parameters(fn) == _parameters(target), fn.fleet_verb
