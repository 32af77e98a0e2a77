"""The flags' names (`vime.config.algorithm`, `vime.algorithms.names`: torch-free) are exactly what the registries
implement."""

from vime.algorithms.advantages import ADVANTAGE_ESTIMATORS
from vime.algorithms.losses import POLICY_LOSSES
from vime.config.algorithm import ADVANTAGE_ESTIMATOR_NAMES, POLICY_LOSS_NAMES


def test_flag_choices_are_the_registered_estimators_and_losses():
    assert set(ADVANTAGE_ESTIMATOR_NAMES) == set(ADVANTAGE_ESTIMATORS)
    assert set(POLICY_LOSS_NAMES) == set(POLICY_LOSSES)
