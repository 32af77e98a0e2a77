"""`--environment reasoning_gym:<dataset>[,<dataset>...]`: reasoning-gym's procedural tasks, scored exactly.

Each dataset is its own environment of the mixture (named after the dataset; its reward reported on its own):
`reasoning_gym.create_dataset(name, size, seed, **config)` makes the entries, its `score_answer(answer, entry)`
scores the answer the response puts in <answer>...</answer> (reasoning-gym's `extract_answer`). Training prompts
are entries 0 .. --reasoning-gym-size - 1, eval prompts the --environment-eval-size entries after them (each
entry is generated from the seed and its index, so eval questions are others than training ones). A sample keeps
only its dataset and entry index in its metadata; the entry is generated again to score it.

`--environment-args` for a reasoning_gym spec: {"<dataset>": {config field: value}} (the dataset's config
dataclass fields, e.g. {"basic_arithmetic": {"min_terms": 2, "max_terms": 2}}), plus optional "system_prompt"
(a key of reasoning_gym.utils.SYSTEM_PROMPTS, or "none"; default: --reasoning-gym-system-prompt).
"""

from __future__ import annotations

from typing import Any

from vime.config.agents import EnvironmentConfig
from vime.config.rollout import PromptDataConfig
from vime.config.run import JobConfig
from vime.data.sample import Sample
from vime.environments.base import Environment, EnvironmentSpec, import_optional, prompt_sample, record_functions

ENTRY_KEY = "reasoning_gym"  # metadata: {"dataset": name, "index": entry index}


def _rg():
    return import_optional("reasoning_gym", "reasoning_gym", "reasoning-gym")


class ReasoningGymEnvironment(Environment):
    def __init__(self, dataset: str, weight: float, size: int, eval_size: int, seed: int,
                 config: dict[str, Any], system_prompt: str | None):
        rg = _rg()
        self.name, self.weight, self.size = dataset, weight, size
        try:
            self.dataset = rg.create_dataset(dataset, size=size + eval_size, seed=seed, **config)
        except (ValueError, TypeError, AssertionError) as e:  # unknown name, unknown or invalid config field
            raise ValueError(f"--environment reasoning_gym:{dataset}: {type(e).__name__}: {e}") from None
        self.system_prompt = system_prompt

    def _prompts(self, tokenizer, args, indices) -> list[Sample]:
        prompt_data = PromptDataConfig.of(args)
        prompts = []
        for i in indices:
            entry = self.dataset[i]
            messages = [{"role": "user", "content": entry["question"]}]
            if self.system_prompt:
                messages.insert(0, {"role": "system", "content": self.system_prompt})
            chat = messages if prompt_data.apply_chat_template else _plain(messages)
            prompts.append(prompt_sample(chat, tokenizer, args,
                                         environment=self.name, label=str(entry["answer"]),
                                         metadata={ENTRY_KEY: {"dataset": self.name, "index": i}},
                                         where=f"reasoning_gym {self.name} entry {i}"))
        return prompts

    def train_prompts(self, tokenizer, args) -> list[Sample]:
        return self._prompts(tokenizer, args, range(self.size))

    def eval_prompts(self, tokenizer, args, n: int) -> list[Sample]:
        if self.size + n > len(self.dataset):
            raise ValueError(f"reasoning_gym {self.name}: {n} eval entries asked, made for "
                             f"{len(self.dataset) - self.size}")
        return self._prompts(tokenizer, args, range(self.size, self.size + n))

    async def score(self, args, sample: Sample) -> float:
        extract_answer = import_optional("reasoning_gym.utils", "reasoning_gym", "reasoning-gym").extract_answer
        entry = self.dataset[int(sample.metadata[ENTRY_KEY]["index"])]
        answer = extract_answer(sample.response)
        value = float(self.dataset.score_answer(answer=answer, entry=entry))
        if answer is not None:
            sample.metadata["eval_answer"] = answer  # what maj@k votes on
        record_functions(sample, {"score_answer": value}, {"score_answer": 1.0})
        return value


def _plain(messages: list[dict[str, str]]) -> str:
    """Without a chat template: the system prompt and the question as plain text."""
    return "\n".join(m["content"] for m in messages)


def load(spec: EnvironmentSpec, args) -> list[ReasoningGymEnvironment]:
    environments = EnvironmentConfig.of(args)
    job = JobConfig.of(args)
    datasets = [d.strip() for d in spec.target.split(",") if d.strip()]
    if not datasets:
        raise ValueError(f"--environment reasoning_gym:{spec.target}: name at least one dataset")
    config = dict(spec.config)
    system = config.pop("system_prompt", environments.reasoning_gym_system_prompt)
    unknown = sorted(set(config) - set(datasets))
    if unknown:
        raise ValueError(f"--environment-args for reasoning_gym:{spec.target}: keys {', '.join(unknown)} name no "
                         f"dataset of the spec; give {{\"<dataset>\": {{config field: value}}}}")
    weights = dict(zip(datasets, _dataset_weights(args, spec, datasets)))
    total = sum(weights.values())
    prompts = import_optional("reasoning_gym.utils", "reasoning_gym", "reasoning-gym").SYSTEM_PROMPTS
    if system != "none" and system not in prompts:
        raise ValueError(f"reasoning_gym system prompt {system!r}: not one of none, {', '.join(prompts)}")
    seed = environments.reasoning_gym_seed if environments.reasoning_gym_seed is not None else job.seed
    return [ReasoningGymEnvironment(name, spec.weight * weights[name] / total, environments.reasoning_gym_size,
                                    environments.environment_eval_size or 0, seed, config.get(name, {}),
                                    None if system == "none" else prompts[system])
            for name in datasets]


def _dataset_weights(args, spec: EnvironmentSpec, datasets: list[str]) -> list[float]:
    environments = EnvironmentConfig.of(args)
    weights = environments.reasoning_gym_weights
    if not weights:
        return [1.0] * len(datasets)
    if len(weights) != len(datasets):
        raise ValueError(f"--reasoning-gym-weights: {len(weights)} weights for the {len(datasets)} datasets of "
                         f"reasoning_gym:{spec.target}")
    if not all(w > 0 for w in weights):
        raise ValueError(f"--reasoning-gym-weights must be > 0, got {weights}")
    return [float(w) for w in weights]
