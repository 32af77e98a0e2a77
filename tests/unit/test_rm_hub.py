"""Reward hub: every built-in type, the dispatcher, custom and group reward paths, the remote reward client."""

import asyncio
import http.server
import json
import threading
import time
from types import SimpleNamespace

import pytest

from vime.data.sample import Sample
from vime.rollout import rm_hub
from vime.rollout.context import reset_rollout_context
from vime.rollout.metrics import take_counters
from vime.rollout.rm_hub import RM_REGISTRY, async_rm, batched_async_rm, register_rm, remote_rm
from vime.rollout.rm_hub.answer_utils import last_boxed, normalize_answer
from vime.rollout.rm_hub.pool import close_reward_pool, reward_pool
from vime.rollout.vllm_rollout import _reward_one


def make_args(**overrides):
    args = SimpleNamespace(rm_type="math", custom_rm_path=None, group_rm=False, rm_url=None, rm_max_retries=3,
                           rm_timeout=30.0, reward_key=None, seed=1234)
    for k, v in overrides.items():
        setattr(args, k, v)
    return args


def reward(rm_type, response, label, **sample_fields):
    sample = Sample(index=7, response=response, label=label, **sample_fields)
    return asyncio.run(async_rm(make_args(rm_type=rm_type), sample))


# ---- answer helpers ----

def test_last_boxed_handles_nesting_and_picks_last():
    assert last_boxed(r"first \boxed{1}, then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{\left\{1,\{2\}\right\}}") == r"\left\{1,\{2\}\right\}"
    assert last_boxed("no box here") is None
    assert last_boxed(r"truncated \boxed{\frac{1}{2}") is None


def test_normalize_answer():
    assert normalize_answer(r" \left( 1, 2 \right). ") == "(1,2)"
    assert normalize_answer(r"10\text{ cm}") == "10cm"
    assert normalize_answer(r"\dfrac{1}{2}") == normalize_answer(r"\frac{1}{2}")
    assert normalize_answer(r"1\!000") == "1000"
    assert normalize_answer(r"\leftarrow") == r"\leftarrow"


# ---- math (math_verify) ----

@pytest.mark.parametrize("response,label", [
    (r"so the answer is \boxed{0.5}", r"\frac{1}{2}"),
    (r"\boxed{\frac{1}{2}}", "0.5"),
    (r"\boxed{\frac{1}{2}}", "1/2"),
    (r"\boxed{\dfrac{1}{2}}", "0.5"),
    (r"\boxed{\sqrt{8}}", r"2\sqrt{2}"),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}"),
    (r"\boxed{1+x^2}", "x^2+1"),
    (r"\boxed{\frac{\pi}{2}}", r"\pi/2"),
    (r"\boxed{0.5}", r"50\%"),
    (r"\boxed{10.}", "10"),
    (r"try \boxed{3}, no wait: \boxed{5}", "5"),
    (r"We get $x = \frac{1}{2}$.", "0.5"),  # no box: the final expression
    ("the answer is 42", "42"),
    (r"\boxed{4}", r"\boxed{4}"),
    (r"\boxed{7}", 7),  # non-string label
])
def test_math_equivalent_notations_score_one(response, label):
    assert reward("math", response, label) == 1.0


@pytest.mark.parametrize("response,label", [
    (r"\boxed{\frac{1}{3}}", "0.5"),
    (r"\boxed{\sqrt{2}}", r"2\sqrt{2}"),
    (r"try \boxed{5}, no wait: \boxed{3}", "5"),  # the last box counts
    ("", "5"),
    ("I cannot solve this.", "5"),
    (r"truncated \boxed{", "5"),
])
def test_math_wrong_or_missing_answers_score_zero(response, label):
    assert reward("math", response, label) == 0.0


def test_math_runs_off_the_main_thread():
    # math_verify's default signal timeouts raise off the main thread; ours are disabled.
    args = make_args(rm_type="math")
    samples = [Sample(index=i, response=rf"\boxed{{{i}/{i + 1}}}", label=rf"\frac{{{i}}}{{{i + 1}}}")
               for i in range(1, 9)]

    async def score_all():
        return await asyncio.gather(*(async_rm(args, s) for s in samples))

    assert asyncio.run(score_all()) == [1.0] * 8


@pytest.fixture(autouse=True, scope="module")
def _close_reward_workers():
    yield
    close_reward_pool()


@pytest.fixture
def fresh_reward_pool(tmp_path, monkeypatch):
    """A reward pool started for this test, whose workers see `tmp_path` on sys.path (for stand-in functions)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    close_reward_pool()
    reset_rollout_context()
    yield tmp_path
    close_reward_pool()


def test_math_answer_that_hangs_sympy_is_killed_at_the_timeout(fresh_reward_pool):
    args = make_args(rm_type="math", rm_timeout=3.0, rm_num_workers=1)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="sample 2: math_verify took over --rm-timeout 3s"):
        asyncio.run(async_rm(args, Sample(index=2, response=r"\boxed{9^{9^{9^{9^{9}}}}}", label="1")))
    assert time.monotonic() - start < 4.5
    pool = reward_pool(args)
    assert pool.replaced == 1 and len(pool.started_pids) == 2
    assert take_counters() == {"rollout/reward_workers_replaced": 1.0}
    assert asyncio.run(async_rm(args, Sample(response=r"\boxed{\sqrt{8}}", label=r"2\sqrt{2}"))) == 1.0  # replacement


# ---- boxed / deepscaler ----

def test_boxed_nested_and_normalised():
    assert reward("boxed", r"thus \boxed{\frac{1}{2}}", r"\frac{1}{2}") == 1.0
    assert reward("boxed", r"\boxed{ \left( 1, 2 \right) .}", "(1,2)") == 1.0
    assert reward("boxed", r"\boxed{5\text{ cm}}", "5cm") == 1.0
    assert reward("boxed", r"\boxed{\dfrac{1}{2}}", r"\boxed{\frac{1}{2}}") == 1.0


def test_boxed_is_string_wise():
    assert reward("boxed", r"\boxed{0.5}", r"\frac{1}{2}") == 0.0  # unlike math
    assert reward("boxed", "the answer is 3", "3") == 0.0  # no box
    assert reward("boxed", "", "3") == 0.0


def test_deepscaler_grades_only_after_think():
    assert reward("deepscaler", r"<think>maybe \boxed{2}</think> so \boxed{3}", "3") == 1.0
    assert reward("deepscaler", r"<think>it is \boxed{3}</think> final: \boxed{2}", "3") == 0.0
    assert reward("deepscaler", r"<think>it is \boxed{3}</think> no box after", "3") == 0.0
    assert reward("deepscaler", r"no think tags \boxed{3}", "3") == 0.0


# ---- dapo ----

def test_dapo_one_or_minus_one():
    assert reward("dapo", "some work\nAnswer: 34", "34") == 1.0
    assert reward("dapo", "Answer: 12\nrecheck...\nanswer:  $34$ ", "34") == 1.0  # the last one counts
    assert reward("dapo", r"Answer: \boxed{34}", "34") == 1.0
    assert reward("dapo", "Answer: 35", "34") == -1.0
    assert reward("dapo", "the result is 34", "34") == -1.0
    assert reward("dapo", "", "34") == -1.0


# ---- exact_match / f1 ----

def test_exact_match():
    assert reward("exact_match", "  Paris\n", "Paris") == 1.0
    assert reward("exact_match", "paris", "Paris") == 0.0
    assert reward("exact_match", "", "Paris") == 0.0


def test_f1_partial_overlap_hand_computed():
    # pred tokens [cat, sat, on, mat], gold [cat, on, hat]: common 2, P = 1/2, R = 2/3, F1 = 4/7
    assert reward("f1", "The cat sat on the mat.", "a cat on a hat") == pytest.approx(4 / 7)
    assert reward("f1", "The Eiffel Tower!", "eiffel tower") == 1.0
    assert reward("f1", "nothing shared", "eiffel tower") == 0.0
    assert reward("f1", "", "eiffel tower") == 0.0
    assert reward("f1", "cat cat", "cat") == pytest.approx(2 / 3)  # P = 1/2, R = 1


# ---- gpqa ----

@pytest.mark.parametrize("response", [
    "Answer: C",
    "After elimination, the answer is (C).",
    "**Answer:** C",
    r"So the final choice is \boxed{C}",
    r"\boxed{\text{(C)}}",
    "Options (A) and (B) are wrong, so (C)",
    "A is wrong and B too. I pick C",
])
def test_gpqa_patterns(response):
    assert reward("gpqa", response, "C") == 1.0


def test_gpqa_wrong_missing_and_label_forms():
    assert reward("gpqa", "Answer: B", "C") == 0.0
    assert reward("gpqa", "i don't know", "C") == 0.0
    assert reward("gpqa", "", "C") == 0.0
    assert reward("gpqa", "Answer: E", "C") == 0.0  # E is not an option out of four
    assert reward("gpqa", "Answer: (B)", "(B)") == 1.0
    assert reward("gpqa", "Answer: B", 1) == 1.0  # 0-based index label
    choices = ["red", "green", "blue", "cyan", "pink", "gray"]
    assert reward("gpqa", "Answer: F", "F", metadata={"choices": choices}) == 1.0
    assert reward("gpqa", "Answer: C", "blue", metadata={"choices": choices}) == 1.0
    with pytest.raises(ValueError, match="not one of the options"):
        reward("gpqa", "Answer: C", "Z")


# ---- random ----

def test_random_is_reproducible_and_binary():
    args = make_args(rm_type="random", seed=3)
    values = [asyncio.run(async_rm(args, Sample(index=i))) for i in range(40)]
    again = [asyncio.run(async_rm(args, Sample(index=i))) for i in range(40)]
    assert values == again
    assert set(values) == {0.0, 1.0}


# ---- dispatcher ----

def test_unknown_rm_type_lists_known_names():
    with pytest.raises(ValueError, match="unknown --rm-type 'nope'.*'exact_match'.*'math'"):
        reward("nope", "x", "x")


def test_missing_label_names_sample_and_type():
    with pytest.raises(ValueError, match="sample 7: label is None.*'math'"):
        reward("math", r"\boxed{1}", None)
    assert reward("random", "x", None) in (0.0, 1.0)  # random needs no label


def test_registry_decorator_adds_a_type():
    @register_rm("test_length")
    def length_rm(args, sample):
        return float(len(sample.response))

    try:
        assert "test_length" in RM_REGISTRY
        assert reward("test_length", "abcd", "x") == 4.0
        with pytest.raises(ValueError, match="already registered"):
            register_rm("test_length")(length_rm)
    finally:
        del RM_REGISTRY["test_length"]


@pytest.fixture
def custom_rm_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "async def async_reward(args, sample, **kwargs):\n"
        "    return {'acc': 1.0 if sample.response == sample.label else 0.0, 'extra': kwargs.get('extra')}\n"
        "def sync_reward(args, sample):\n"
        "    return float(len(sample.response))\n"
        "def group_reward(args, samples):\n"
        "    return [float(i) for i, _ in enumerate(samples)]\n"
        "async def bad_group_reward(args, samples):\n"
        "    return [0.0]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards"


def test_custom_rm_path_async_and_sync(custom_rm_module):
    sample = Sample(index=0, response="x", label="x")
    args = make_args(rm_type="nope", custom_rm_path=f"{custom_rm_module}.async_reward")  # custom wins over rm_type
    assert asyncio.run(async_rm(args, sample, extra=5)) == {"acc": 1.0, "extra": 5}
    args = make_args(custom_rm_path=f"{custom_rm_module}.sync_reward")
    assert asyncio.run(async_rm(args, Sample(response="abc"))) == 3.0


def test_batched_async_rm_per_sample_keeps_order():
    samples = [Sample(index=i, response=rf"\boxed{{{i}}}", label=str(i if i % 2 else i + 1)) for i in range(6)]
    assert asyncio.run(batched_async_rm(make_args(rm_type="math"), samples)) == [0.0, 1.0] * 3


def test_group_rm_calls_once_and_checks_length(custom_rm_module):
    samples = [Sample(index=i) for i in range(3)]
    args = make_args(group_rm=True, custom_rm_path=f"{custom_rm_module}.group_reward")
    assert asyncio.run(batched_async_rm(args, samples)) == [0.0, 1.0, 2.0]
    args = make_args(group_rm=True, custom_rm_path=f"{custom_rm_module}.bad_group_reward")
    with pytest.raises(ValueError, match="returned 1 rewards for 3 samples"):
        asyncio.run(batched_async_rm(args, samples))


def test_custom_rm_in_workers_gets_args_and_sample_copies(fresh_reward_pool):
    (fresh_reward_pool / "pooled_rewards.py").write_text(
        "import os\n"
        "def sync_reward(args, sample, bonus=0.0):\n"
        "    return {'pid': os.getpid(), 'seed': args.seed, 'len': len(sample.tokens), 'label': sample.label,\n"
        "            'status': sample.status.value, 'bonus': bonus}\n"
        "async def group_reward(args, samples):\n"
        "    return [float(s.index) for s in samples]\n"
    )
    args = make_args(custom_rm_path="pooled_rewards.sync_reward", custom_rm_in_workers=True, rm_num_workers=1,
                     tokenizer=object())  # not JSON-able: stays behind
    sample = Sample(index=1, tokens=[1, 2, 3], label={"a": [1]}, status=Sample.Status.TRUNCATED)
    got = asyncio.run(async_rm(args, sample, bonus=0.5))
    assert got == {"pid": reward_pool(args).started_pids[0], "seed": 1234, "len": 3, "label": {"a": [1]},
                   "status": "truncated", "bonus": 0.5}
    args.custom_rm_path, args.group_rm = "pooled_rewards.group_reward", True
    assert asyncio.run(batched_async_rm(args, [Sample(index=i) for i in (4, 2)])) == [4.0, 2.0]


def test_custom_rm_in_workers_needs_an_importable_path(fresh_reward_pool):
    args = make_args(custom_rm_path="no_such_module_xyz.reward", custom_rm_in_workers=True, rm_num_workers=1)
    with pytest.raises(RuntimeError, match="no_such_module_xyz.*must name a function in a module on sys.path"):
        asyncio.run(async_rm(args, Sample(index=0)))


def test_custom_rm_in_workers_names_what_is_not_json(fresh_reward_pool):
    args = make_args(custom_rm_path="any.reward", custom_rm_in_workers=True, rm_num_workers=1)
    with pytest.raises(TypeError, match="any.reward to a worker as JSON: object is not JSON-able; keep sample"):
        asyncio.run(async_rm(args, Sample(index=0, metadata={"handle": object()})))


# ---- remote_rm against a real local HTTP server ----

class RewardServer:
    """Answers POSTs from a script of (status, body) pairs, (None, seconds) to hang; repeats the last one. Records
    request bodies."""

    def __init__(self, script):
        self.script = list(script)
        self.requests = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                server.requests.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                status, body = server.script.pop(0) if len(server.script) > 1 else server.script[0]
                if status is None:  # (None, seconds): hang, then drop the connection
                    time.sleep(body)
                    return
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/reward"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def reward_server(monkeypatch):
    monkeypatch.setattr(remote_rm, "BACKOFF_BASE_S", 0.01)
    servers = []

    def start(*script):
        servers.append(RewardServer(script))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def remote_reward(url, sample=None, **arg_overrides):
    sample = sample or Sample(index=3, prompt="1+1?", response="2", label="2", metadata={"k": "v"})
    return asyncio.run(async_rm(make_args(rm_type="remote_rm", rm_url=url, **arg_overrides), sample))


def test_remote_rm_number_and_reward_dict(reward_server):
    server = reward_server((200, 0.25))
    assert remote_reward(server.url) == 0.25
    assert server.requests == [{"prompt": "1+1?", "response": "2", "label": "2", "metadata": {"k": "v"}}]
    assert remote_reward(reward_server((200, {"reward": 1})).url) == 1.0
    multi = {"reward": 1.0, "format": 0.5}
    assert remote_reward(reward_server((200, multi)).url) == multi


def test_remote_rm_retries_after_500(reward_server):
    server = reward_server((500, {"error": "busy"}), (200, {"reward": 0.75}))
    assert remote_reward(server.url) == 0.75
    assert len(server.requests) == 2


def test_remote_rm_exhausted_retries_names_url(reward_server):
    server = reward_server((503, {"error": "down"}))
    with pytest.raises(RuntimeError, match=f"{server.url} failed 3 times within --rm-timeout 30s.*503"):
        remote_reward(server.url, rm_max_retries=2)
    assert len(server.requests) == 3


def test_remote_rm_unreachable_and_bad_body(reward_server):
    server = reward_server((200, "not a reward"))
    with pytest.raises(ValueError, match="expected a number"):
        remote_reward(server.url)
    dead_url = server.url.replace(str(server.httpd.server_address[1]), "1")  # nothing listens on port 1
    with pytest.raises(RuntimeError, match="127.0.0.1:1/reward failed 2 times"):
        remote_reward(dead_url, rm_max_retries=1)


@pytest.mark.parametrize("body", [float("nan"), float("inf"), {"reward": float("-inf"), "acc": 1.0}])
def test_remote_rm_non_finite_reward_fails_clearly(reward_server, body):
    server = reward_server((200, body))
    with pytest.raises(remote_rm.NonFiniteRewardError, match=f"reward server {server.url} returned a non-finite"
                       r".*(nan|inf)"):
        remote_reward(server.url)
    assert len(server.requests) == 1  # a wrong value is not retried


def test_remote_rm_non_finite_reward_fails_the_sample(reward_server):
    server = reward_server((200, float("nan")))
    sample = Sample(index=5, response="2", label="2", status=Sample.Status.COMPLETED)
    asyncio.run(_reward_one(make_args(rm_type="remote_rm", rm_url=server.url), sample))
    assert sample.status == Sample.Status.FAILED and sample.reward is None
    failure = sample.metadata["failure"]
    assert failure["stage"] == "reward" and failure["reason"] == "non_finite"
    assert server.url in failure["error"] and "nan" in failure["error"]


def test_remote_rm_retries_an_attempt_that_hangs(reward_server):
    server = reward_server((None, 5.0), (200, {"reward": 0.5}))
    start = time.monotonic()
    assert remote_reward(server.url, rm_timeout=4.0, rm_max_retries=1) == 0.5  # first attempt: 2 s of the 4
    assert len(server.requests) == 2 and time.monotonic() - start < 3.5


def test_remote_rm_attempts_share_the_deadline(reward_server):
    server = reward_server((None, 5.0))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=f"{server.url} failed 3 times within --rm-timeout 1.5s.*Timeout"):
        remote_reward(server.url, rm_timeout=1.5, rm_max_retries=2)
    assert 1.4 < time.monotonic() - start < 2.5 and len(server.requests) == 3


def test_remote_rm_needs_url():
    with pytest.raises(ValueError, match="needs --rm-url"):
        remote_reward(None)


def test_public_names():
    assert set(rm_hub.__all__) == {"RM_REGISTRY", "RewardTypeError", "async_rm", "batched_async_rm", "register_rm"}
    builtin = {"math", "boxed", "deepscaler", "dapo", "exact_match", "f1", "gpqa", "remote_rm", "random"}
    assert builtin <= set(RM_REGISTRY)


HUNG = threading.Event()  # set at the end of the test: the hung reward calls return and free their threads


def _hung_reward(args, sample):
    HUNG.wait(60)
    return 1.0


def test_hung_sync_rewards_hold_a_bounded_number_of_threads(monkeypatch):
    """Sync reward calls that never return hold their threads past --rm-timeout (a thread cannot be stopped); once
    all reward threads are held, the next sample fails at once, recorded as a reward error naming the way out,
    instead of waiting behind them forever; the threads come back when the calls return."""
    threads = rm_hub.RewardThreads(limit=2)
    monkeypatch.setattr(rm_hub, "reward_threads", lambda: threads)
    monkeypatch.setattr(rm_hub, "load_function", lambda path: _hung_reward)
    HUNG.clear()
    args = make_args(rm_type=None, custom_rm_path="tests.unit.test_rm_hub._hung_reward", rm_timeout=0.5)

    async def score(n):
        samples = [Sample(index=i, response="x", label="1") for i in range(n)]
        await asyncio.gather(*(_reward_one(args, s) for s in samples))
        return samples

    try:
        timed_out = asyncio.run(score(2))
        assert [s.metadata["failure"]["reason"] for s in timed_out] == ["timeout", "timeout"]
        assert threads.busy == 2  # still held by the hung calls
        start = time.monotonic()
        [refused] = asyncio.run(score(1))
        assert time.monotonic() - start < 0.4  # at once, not after --rm-timeout
        assert refused.metadata["failure"]["reason"] == "error"
        assert "all 2 reward threads are held" in refused.metadata["failure"]["error"]
        assert "--custom-rm-in-workers" in refused.metadata["failure"]["error"]
    finally:
        HUNG.set()
    deadline = time.monotonic() + 10
    while threads.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threads.busy == 0
