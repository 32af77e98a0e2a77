"""slime's import path for the sample types (`from slime.utils.types import Sample` in a slime plugin becomes
`from vime.utils.types import Sample`). The types live in vime/data/sample.py; this module only hands them on."""

from vime.data.sample import RolloutFnEvalOutput, RolloutFnTrainOutput, Sample

__all__ = ["RolloutFnEvalOutput", "RolloutFnTrainOutput", "Sample"]
