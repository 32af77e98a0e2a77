"""The verbs that cross a process boundary are methods declared where they run, so go-to-definition finds them:
`@group_call` on `RayTrainGroup` runs the `TrainActor` method of the same name on its ranks, and the actor's and the
rollout manager's forwarding methods call their trainer's and fleet's by name. Each must name a method that exists
on the other side with the same parameters, so a rename there cannot leave a verb that fails only when a run first
calls it."""

from __future__ import annotations

import ast
import inspect
import textwrap

from vime.driver import train_group as actor_group
from vime.driver.train_group import RayTrainGroup, TrainActor
from vime.rollout_manager.engine_fleet import EngineFleet
from vime.rollout_manager.fleet_recovery import FleetRecovery
from vime.rollout_manager.manager import RolloutManager
from vime.trainer.trainer import MegatronTrainer


def _parameters(fn) -> list[tuple[str, object]]:
    # without self, and without what Ray adds to an actor's methods (`_ray_trace_ctx`)
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()
            if not p.name.startswith("_ray")][1:]


def _forwarded(cls, *owner: str) -> dict[str, list[str]]:
    """method name -> the `self.<owner>.<name>` attributes its body reads (`owner` one attribute, or a path of them:
    "fleet", "recovery" for `self.fleet.recovery.<name>`)."""
    found = {}
    for name, fn in vars(cls).items():
        if name.startswith("_") or not inspect.isfunction(fn):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn))))
        found[name] = [node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                       and _path(node.value) == ["self", *owner]]
    return found


def _path(node: ast.AST) -> list[str]:
    """["self", "fleet", "recovery"] of `self.fleet.recovery`; [] for what is not a chain of names."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [*_path(node.value), node.attr] if _path(node.value) else []
    return []


def test_every_group_verb_is_an_actor_method_with_its_parameters():
    verbs = {name: fn for name, fn in vars(RayTrainGroup).items() if hasattr(fn, "group_call")}
    assert len(verbs) == 10
    for name, fn in verbs.items():
        assert fn.__name__ == name and fn.__doc__, name
        assert _parameters(fn) == _parameters(getattr(TrainActor, name)), name
        assert fn.group_call.ranks in ("all", "first") and fn.group_call.deadline in ("work", "control")


def test_every_trainer_call_of_the_actor_exists_and_a_forward_has_the_trainers_parameters():
    calls = _forwarded(TrainActor, "trainer")
    assert not [(m, c) for m, names in calls.items() for c in names if not callable(getattr(MegatronTrainer, c, None))]
    forwards = ("onload", "save", "save_hf", "get_loaded_state", "set_plugin_values", "compute_kind", "probe_log_probs")
    assert all(calls[name] == [name] for name in forwards)
    for name in forwards:
        assert _parameters(getattr(TrainActor, name)) == _parameters(getattr(MegatronTrainer, name)), name


def test_every_fleet_call_of_the_rollout_manager_exists_on_the_fleet():
    calls = _forwarded(RolloutManager.__ray_actor_class__, "fleet")
    assert sum(1 for names in calls.values() if names) >= 10
    assert not [(m, c) for m, names in calls.items() for c in names if not hasattr(EngineFleet, c) and c != "recovery"]
    # what keeps the engines serving is the fleet's recovery part's (`self.fleet.recovery.<verb>`)
    recovery = _forwarded(RolloutManager.__ray_actor_class__, "fleet", "recovery")
    assert sum(1 for names in recovery.values() if names) >= 6
    assert not [(m, c) for m, names in recovery.items() for c in names if not callable(getattr(FleetRecovery, c, None))]
    manager = RolloutManager.__ray_actor_class__
    for name in ("apply_weights", "probe_log_probs", "wake_up"):
        assert _parameters(inspect.unwrap(getattr(manager, name))) == _parameters(getattr(EngineFleet, name)), name
    # a weight update runs beside a rollout in progress: its verbs are in the manager's "weights" group
    for name in ("apply_weights", "get_engine_urls", "get_live_engine_urls"):
        assert getattr(manager, name).__ray_concurrency_group__ == "weights", name


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


def test_the_default_rollout_function_is_an_import_that_its_flag_names():
    """The manager calls the default rollout function through an import (go-to-definition follows it), which must
    be the function --rollout-function-path's default names; another path is loaded from it."""
    from vime.config.rollout import RolloutConfig
    from vime.rollout import sft_rollout
    from vime.rollout_manager.manager import rollout_function

    default = RolloutConfig().rollout_function_path
    fn = rollout_function(default)
    assert f"{fn.__module__}.{fn.__name__}" == default
    assert rollout_function("vime.rollout.sft_rollout.generate_rollout") is sft_rollout.generate_rollout
