"""Multi-LoRA on the rollout side (--lora-adapters): the adapter mix data source (shares, numbering, tags, given-back
groups, resume), the manager's sources, flag validation, the served model of every request path, per-adapter
rewards and metrics. No engine: a fake token-in/token-out router answers."""

from __future__ import annotations

import asyncio
import json
import textwrap
from collections import Counter
from types import SimpleNamespace

import pytest
from aiohttp import web

from tests.helpers.plugins import rollout_plugin, run as _run
from vime.data.adapter_mix import AdapterMixSource
from vime.data.sample import ADAPTER_KEY, Sample
from vime.rollout.context import reset_rollout_context, rollout_context
from vime.rollout.generation import served_model
from vime.rollout.metrics import rollout_metrics, take_counters
from vime.rollout.rm_hub import RewardTypeError, async_rm
from vime.rollout.vllm_rollout import GenerateState, generate_rollout_async


def _prompts(tag, n):
    return [Sample(prompt=f"{tag}{i}", tokens=[i + 1], label=str(i)) for i in range(n)]


def _adapters(groups):
    return [g[0].metadata[ADAPTER_KEY] for g in groups]


# ---- the data source --------------------------------------------------------------------------------------------

def test_each_call_takes_an_equal_share_per_adapter_numbered_over_the_run():
    source = AdapterMixSource({"a": _prompts("a", 3), "b": _prompts("b", 2)}, n_samples_per_prompt=2, seed=0,
                              shuffle=False)
    groups = source.get_samples(4) + source.get_samples(4)
    assert [g[0].prompt for g in groups] == ["a0", "b0", "a1", "b1", "a2", "b0", "a0", "b1"]  # each its own epochs
    assert all(s.metadata[ADAPTER_KEY] == g[0].prompt[0] for g in groups for s in g)
    assert [s.index for g in groups for s in g] == list(range(16))  # as one prompt file numbers them
    assert [[s.group_index for s in g] for g in groups] == [[k, k] for k in range(8)]
    assert len(source.prompts) == 5 and source.prompts[0].metadata == {}  # copies are tagged, not the prompts


def test_an_uneven_call_gives_the_extra_groups_to_the_adapters_in_turn():
    source = AdapterMixSource({name: _prompts(name, 4) for name in "abc"}, 1, seed=0, shuffle=False)
    calls = [_adapters(source.get_samples(4)) for _ in range(3)]
    assert calls == [["a", "b", "c", "a"], ["b", "c", "a", "b"], ["c", "a", "b", "c"]]
    assert Counter(sum(calls, [])) == {"a": 4, "b": 4, "c": 4}
    assert [_adapters(source.get_samples(1)) for _ in range(3)] == [["a"], ["b"], ["c"]]


def test_groups_given_back_keep_their_tag_are_served_first_and_count_in_their_share():
    source = AdapterMixSource({"a": _prompts("a", 4), "b": _prompts("b", 4)}, 1, seed=0, shuffle=False)
    first = source.get_samples(4)
    source.add_samples([first[2]])  # a cut-off group of adapter a (a1)
    groups = source.get_samples(4)
    assert [g[0].prompt for g in groups] == ["a1", "a2", "b2", "b3"] and _adapters(groups) == ["a", "a", "b", "b"]
    assert groups[0][0].index == 2 and [g[0].index for g in groups[1:]] == [4, 5, 6]

    seen = []

    def newest_first(buffer, num_groups):  # --buffer-filter-path
        seen.append(len(buffer))
        return [buffer.pop()] if buffer else []

    mine = AdapterMixSource({"a": _prompts("a", 4), "b": _prompts("b", 4)}, 1, seed=0, shuffle=False,
                            buffer_filter=newest_first)
    mine.add_samples([mine.get_samples(2)[0], mine.get_samples(2)[1]])
    assert [g[0].prompt for g in mine.get_samples(2)] == ["b1", "a2"] and seen == [0, 0, 2]


def test_each_adapter_shuffles_its_own_prompts():
    def order(prompts, name="a"):
        groups = AdapterMixSource(prompts, 1, seed=3, shuffle=True).get_samples(16)
        return [g[0].prompt for g in groups if g[0].metadata[ADAPTER_KEY] == name]

    with_b = order({"a": _prompts("", 8), "b": _prompts("", 8)})
    assert with_b == order({"a": _prompts("", 8), "c": _prompts("x", 3)})  # whatever the other adapters
    assert with_b != order({"a": _prompts("", 8), "b": _prompts("", 8)}, "b")
    assert sorted(with_b) == sorted(f"{i}" for i in range(8))


def test_a_resumed_source_continues_with_the_same_data():
    def make():
        return AdapterMixSource({"a": _prompts("a", 5), "b": _prompts("b", 3), "c": _prompts("c", 2)}, 2, seed=1,
                                shuffle=True)

    a = make()
    a.get_samples(4)
    a.add_samples([a.get_samples(2)[1]])
    state = json.loads(json.dumps(a.state_dict()))  # survives JSON, as in a checkpoint
    assert state["next_sample_index"] == 12 and state["rotation"] == 0 and state["buffer"][0][0]["metadata"]
    b = make()
    b.load_state_dict(state)
    ga, gb = a.get_samples(5) + a.get_samples(7), b.get_samples(5) + b.get_samples(7)
    assert [[s.to_dict() for s in g] for g in ga] == [[s.to_dict() for s in g] for g in gb]
    assert ga[0][0].index == 10 and {s.metadata[ADAPTER_KEY] for g in ga for s in g} == {"a", "b", "c"}


# ---- the rollout manager's sources ---------------------------------------------------------------------------------

def _source_args(tmp_path, **kw):
    base = dict(input_key="prompt", label_key="label", metadata_key="metadata", tool_key=None,
                apply_chat_template=False, apply_chat_template_kwargs=None, rollout_max_prompt_len=8,
                max_bad_prompt_rows_ratio=0.5, prompt_data=None, lora_adapters=None, buffer_filter_path=None,
                n_samples_per_prompt=2, rollout_seed=0, rollout_shuffle=False, eval_prompt_data=None,
                n_samples_per_eval_prompt=1)
    base.update(kw)
    return SimpleNamespace(**base)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_manager_builds_the_mix_counts_bad_rows_of_every_file_and_tags_eval_sets(tmp_path, tiny_qwen3):
    from vime.rollout_manager.manager import make_data_source, make_eval_sources
    from vime.utils.hf_tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_qwen3))
    math = _write(tmp_path / "math.jsonl", [{"prompt": "1 + 1", "label": "2"}, {"question": "bad"},
                                            {"prompt": "2 + 2", "label": "4"}])
    code = _write(tmp_path / "code.jsonl", [{"prompt": "print(1)", "label": "1"}, {"prompt": "x " * 20, "label": "0"},
                                            {"prompt": "nope"}, {"prompt": "print(2)", "label": "2"}])
    args = _source_args(tmp_path, lora_adapters=[f"math={math}", f"code={code}:exact_match"],
                        eval_prompt_data=["code", str(code), "other", str(math)])
    reset_rollout_context()
    source = make_data_source(args, tokenizer)
    assert take_counters() == {"data/skipped_rows": 2.0, "data/too_long_prompts": 1.0}
    groups = source.get_samples(4)
    assert [g[0].label for g in groups] == ["2", "1", "4", "2"] and _adapters(groups) == ["math", "code"] * 2
    assert [s.index for g in groups for s in g] == list(range(8))

    evals = make_eval_sources(args, tokenizer)
    assert [s.metadata.get(ADAPTER_KEY) for s in evals["code"].get_samples(2)[0]] == ["code"]
    assert ADAPTER_KEY not in evals["other"].get_samples(1)[0][0].metadata  # refused by validation in a real run

    single = make_data_source(_source_args(tmp_path, prompt_data=str(math)), tokenizer)
    assert type(single).__name__ == "RolloutDataSource" and take_counters()["data/skipped_rows"] == 1.0
    assert ADAPTER_KEY not in single.get_samples(1)[0][0].metadata


# ---- flag validation ------------------------------------------------------------------------------------------

@pytest.fixture()
def lora_base(tiny_qwen3, arithmetic_data):
    train, evals = map(str, arithmetic_data)
    return ["--hf-checkpoint", str(tiny_qwen3), "--lora-rank", "4", "--rollout-batch-size", "4"], train, evals


def _error(capsys, argv) -> str:
    from vime.arguments import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv)
    return capsys.readouterr().err


def test_adapters_replace_prompt_data_and_need_a_reward_only_where_they_name_none(lora_base, capsys):
    from vime.arguments import parse_args

    base, train, evals = lora_base
    args = parse_args(base + ["--lora-adapters", f"a={train}:math", f"b={train}:exact_match", "--eval-prompt-data",
                              "b", evals], check_model=False)
    assert args.prompt_data is None and args.rm_type is None and args.custom_rm_path is None
    err = _error(capsys, base + ["--lora-adapters", f"a={train}:math", f"b={train}", f"c={train}", "d=" + train])
    assert "choose a reward: --rm-type" in err and "(for --lora-adapters b, c, d, which name no RM" in err
    err = _error(capsys, base + ["--lora-adapters", f"a={train}:remote_rm", f"b={train}", "--rm-type", "math"])
    assert "--rm-type remote_rm needs --rm-url" in err


@pytest.mark.parametrize("extra, message", [
    (["--lora-adapters", "a={train}", "b={train}", "--rm-type", "math", "--eval-prompt-data", "a", "{evals}",
      "held_out", "{evals}"],
     "--eval-prompt-data held_out: a multi-LoRA run evaluates each eval set with the adapter it is named after; "
     "name it after the adapter it evaluates (one of a, b)"),
    (["--lora-adapters", "a={train}:mth", "b={train}", "--rm-type", "math"],
     "--lora-adapters a: RM 'mth' is neither an --rm-type name ("),
    (["--lora-adapters", "a={train}:no_such_module.reward", "b={train}", "--rm-type", "math"],
     "--lora-adapters: cannot import module 'no_such_module'"),
    (["--lora-adapters", "a={train}:math", "b={train}", "--custom-rm-path", "vime.agents.harness.agent_reward",
      "--group-rm"], "--group-rm scores whole groups with --custom-rm-path; --lora-adapters a name RMs"),
])
def test_adapter_flags_that_cannot_work_are_refused(lora_base, capsys, extra, message):
    base, train, evals = lora_base
    assert message in _error(capsys, base + [x.format(train=train, evals=evals) for x in extra])


# ---- the served model of every request path ------------------------------------------------------------------------

class FakeRouter:
    """/inference/v1/generate: one token per choice, remembering each request's body."""

    def __init__(self):
        self.bodies = []

    async def handle(self, request):
        self.bodies.append(await request.json())
        n = self.bodies[-1]["sampling_params"].get("n") or 1
        return web.json_response({"choices": [{"token_ids": [7], "logprobs": {"content": [{"logprob": -1.0}]},
                                               "finish_reason": "length"} for _ in range(n)]})

    async def __aenter__(self):
        app = web.Application()
        app.router.add_post("/inference/v1/generate", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        rollout_context().router_url = self.url
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()


PLUGIN = textwrap.dedent('''
    def length(args, sample):
        return float(len(sample.response_tokens))

    def nothing(args, sample):
        return None
''')


@pytest.fixture()
def plugin(tmp_path, monkeypatch):
    with rollout_plugin(tmp_path, monkeypatch, "adapter_rewards", PLUGIN):
        yield


def _rollout_args(tiny_qwen3, **kw):
    base = dict(hf_checkpoint=str(tiny_qwen3), rollout_concurrency=64, rollout_request_timeout=5.0,
                rollout_request_retries=0, use_fault_tolerance=False, custom_generate_function_path=None,
                rm_type="random", custom_rm_path=None, group_rm=False, rm_timeout=5.0, reward_key=None,
                rollout_seed=0, seed=0, custom_reward_post_process_path=None, dynamic_sampling_filter_path=None,
                rollout_batch_size=4, over_sampling_batch_size=4, max_dynamic_sampling_rounds=1,
                rollout_temperature=1.0, rollout_top_p=1.0, rollout_top_k=-1, rollout_max_response_len=1,
                rollout_stop=None, rollout_stop_token_ids=None, partial_rollout=False,
                mask_offpolicy_in_partial_rollout=False,
                lora_adapters=["a=a.jsonl", "b=b.jsonl:adapter_rewards.length"])
    base.update(kw)
    return SimpleNamespace(**base)


def test_each_sample_asks_for_its_adapter_one_request_per_group_or_per_sample(tiny_qwen3, plugin):
    async def rollout(args, source):
        async with FakeRouter() as router:
            groups, _ = await generate_rollout_async(args, 0, source)
        return router.bodies, groups

    source = AdapterMixSource({"a": _prompts("a", 2), "b": _prompts("b", 2)}, 3, seed=0, shuffle=False)
    bodies, groups = _run(rollout(_rollout_args(tiny_qwen3), source))
    assert sorted(b["model"] for b in bodies) == ["a", "a", "b", "b"]  # a group is one request (n = 3)
    assert all(b["sampling_params"]["n"] == 3 for b in bodies)
    assert [s.reward for s in groups[1]] == [1.0, 1.0, 1.0]  # b's own RM: one response token

    source.add_samples([[Sample(index=50, group_index=9, tokens=[1], metadata={ADAPTER_KEY: "b"}),
                         Sample(index=52, group_index=9, tokens=[1], metadata={ADAPTER_KEY: "b"})]])
    bodies, _ = _run(rollout(_rollout_args(tiny_qwen3, rollout_batch_size=1, over_sampling_batch_size=1), source))
    assert [(b["model"], b["sampling_params"].get("n")) for b in bodies] == [("b", None), ("b", None)]  # per sample
    assert served_model(Sample()) == "policy" and served_model(Sample(metadata={ADAPTER_KEY: "a"})) == "a"


def test_multi_turn_turns_ask_for_the_samples_adapter(tiny_qwen3, monkeypatch):
    from vime.agents import multi_turn

    models = []

    async def engine(args, token_ids, params, model="policy"):
        models.append(model)
        return {"token_ids": [7], "logprobs": {"content": [{"logprob": -1.0}]}, "finish_reason": "stop"}

    async def environment(args, sample, model_text, turn):
        return [{"role": "tool", "content": "ok"}] if turn < 2 else None

    monkeypatch.setattr(multi_turn, "post_generate", engine)
    GenerateState.reset()
    args = SimpleNamespace(hf_checkpoint=str(tiny_qwen3), rollout_concurrency=4, custom_generate_function_path=None)
    sample = Sample(index=0, tokens=[1, 2], metadata={ADAPTER_KEY: "code"})
    asyncio.run(multi_turn.generate(args, sample, {"max_tokens": 64}, environment=environment, max_turns=3))
    GenerateState.reset()
    assert models == ["code", "code"]


def test_an_agent_episode_asks_for_its_samples_adapter_whatever_model_the_agent_names(tiny_qwen3):
    import openai

    from vime.agents import harness

    class Router(FakeRouter):  # on its own loop: the endpoint and a sync agent run in other threads
        def __init__(self):
            super().__init__()
            import threading

            self.loop = asyncio.new_event_loop()
            threading.Thread(target=self.loop.run_forever, daemon=True).start()
            asyncio.run_coroutine_threadsafe(self.__aenter__(), self.loop).result(10)

    router = Router()
    try:
        context = reset_rollout_context(router_url=router.url)
        args = SimpleNamespace(hf_checkpoint=str(tiny_qwen3), router_policy="consistent_hash",
                               rollout_max_response_len=4, rollout_temperature=1.0, rollout_top_p=1.0,
                               rollout_top_k=-1, apply_chat_template_kwargs=None, rollout_request_timeout=30,
                               rollout_request_retries=0)

        def agent(base_url, session_id, sample):
            client = openai.OpenAI(base_url=base_url, api_key=session_id, max_retries=0)
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
            return 1.0

        generate = harness.agent_generate(agent)
        for tag in ("math", None):
            metadata = {ADAPTER_KEY: tag} if tag else {}
            asyncio.run(generate(args, Sample(index=0, prompt="hi", metadata=metadata), {"max_tokens": 4}))
        assert [b["model"] for b in router.bodies] == ["math", "policy"]
    finally:
        context.close()  # the run's endpoint
        asyncio.run_coroutine_threadsafe(router.__aexit__(), router.loop).result(10)
        router.loop.call_soon_threadsafe(router.loop.stop)


# ---- rewards ----------------------------------------------------------------------------------------------------

def _reward_args(**kw):
    base = dict(rm_type="math", custom_rm_path=None, group_rm=False, rm_timeout=30.0, reward_key=None, seed=0,
                lora_adapters=["a=a.jsonl:exact_match", "b=b.jsonl:adapter_rewards.length", "c=c.jsonl"])
    base.update(kw)
    return SimpleNamespace(**base)


def _scored(adapter, response=r"\boxed{42}", label="42", args=None):
    sample = Sample(index=3, tokens=[1, 2, 3, 4], response=response, response_length=3, label=label,
                    metadata={ADAPTER_KEY: adapter} if adapter else {})
    return asyncio.run(async_rm(args or _reward_args(), sample))


def test_a_sample_is_scored_by_its_adapters_rm_else_by_the_runs(plugin):
    assert _scored("a") == 0.0 and _scored("a", response=" 42 ") == 1.0  # exact_match, not math
    assert _scored("b") == 3.0  # the function path: three response tokens
    assert _scored("c") == 1.0 and _scored(None) == 1.0  # the run's --rm-type math
    assert _scored("c", args=_reward_args(custom_rm_path="adapter_rewards.length", rm_type=None)) == 3.0
    with pytest.raises(ValueError, match="sample 3: label is None, but --lora-adapters a RM 'exact_match' needs one"):
        _scored("a", label=None)
    args = _reward_args(lora_adapters=["b=b.jsonl:adapter_rewards.nothing"])
    with pytest.raises(RewardTypeError, match=r"^--lora-adapters b RM adapter_rewards.nothing returned NoneType"):
        _scored("b", args=args)


def test_an_adapters_function_runs_in_the_reward_workers_with_custom_rm_in_workers(tmp_path, monkeypatch):
    import os

    from vime.rollout.rm_hub.pool import close_reward_pool, reward_pool

    (tmp_path / "pooled_adapter_rewards.py").write_text("import os\ndef pid(args, sample):\n    return os.getpid()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    close_reward_pool()
    try:
        args = _reward_args(lora_adapters=["b=b.jsonl:pooled_adapter_rewards.pid"], custom_rm_in_workers=True,
                            rm_num_workers=1)
        pid = _scored("b", args=args)
        assert pid == reward_pool(args).started_pids[0] != os.getpid()
    finally:
        close_reward_pool()


# ---- metrics -----------------------------------------------------------------------------------------------------

def test_per_adapter_metrics_beside_the_run_wide_ones():
    def sample(adapter, reward, length, status=Sample.Status.COMPLETED):
        return Sample(reward=reward, response_length=length, status=status, metadata={ADAPTER_KEY: adapter})

    samples = [sample("a", 1.0, 4), sample("a", 0.0, 8, Sample.Status.TRUNCATED), sample("a", 0.5, 6),
               sample("b", 2.0, 10), sample("b", None, 0, Sample.Status.FAILED)]
    args = SimpleNamespace(reward_key=None, lora_adapters=["a=a.jsonl", "b=b.jsonl:f1", "idle=c.jsonl"])
    reset_rollout_context()
    m = rollout_metrics(samples, args)
    assert m["rollout/reward_mean"] == pytest.approx(3.5 / 4) and m["rollout/num_samples"] == 5
    assert m["rollout/adapter/a/reward_mean"] == 0.5 and m["rollout/adapter/a/response_len_mean"] == 6.0
    assert m["rollout/adapter/a/truncated_ratio"] == pytest.approx(1 / 3) and m["rollout/adapter/a/num_samples"] == 3
    assert m["rollout/adapter/b/reward_mean"] == 2.0 and m["rollout/adapter/b/response_len_mean"] == 5.0
    assert m["rollout/adapter/b/failed_samples"] == 1 and m["rollout/adapter/b/truncated_ratio"] == 0.0
    assert m["rollout/adapter/idle/num_samples"] == 0 and m["rollout/adapter/idle/reward_mean"] == 0.0
    assert not any("adapter" in k for k in rollout_metrics(samples, SimpleNamespace(reward_key=None)))
    assert not any("adapter" in k for k in rollout_metrics(samples, args, prefix="eval/a"))  # per eval set already
