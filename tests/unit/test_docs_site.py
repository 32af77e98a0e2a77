"""The documentation site (docs/, mkdocs.yml) builds with MkDocs in strict mode (any warning fails: a broken link or
anchor, a page left out of the navigation), its search index holds every flag, and every fenced `bash` block of
the guides is either run here (its first line `# runnable`) or says why not (`# gpu-only: ...`,
`# long-running: ...`): the runnable ones run against a saved run in a scratch directory."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_docs_flags import reference_flags
from vime.data.sample import Sample
from vime.rollout.debug_data import save_compact_rollout

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
MARKERS = ("# runnable", "# gpu-only:", "# long-running:")
FENCE = re.compile(r"^(?P<indent> *)```bash\n(?P<body>.*?)^(?P=indent)```$", re.M | re.S)


def bash_blocks() -> list[tuple[str, str]]:
    """(page, block) for every fenced bash block under docs/, indentation removed."""
    blocks = []
    for page in sorted(DOCS.rglob("*.md")):
        for m in FENCE.finditer(page.read_text(encoding="utf-8")):
            indent = len(m["indent"])
            blocks.append((str(page.relative_to(DOCS)), "\n".join(line[indent:] for line in m["body"].splitlines())))
    return blocks


def test_docs_build_strict_and_search_finds_every_flag(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    index = json.loads((tmp_path / "site" / "search" / "search_index.json").read_text())
    titles = [doc["title"] for doc in index["docs"] if doc["location"].startswith("reference/flags/")]
    searchable = {flag for t in titles for flag in re.findall(r"<code>(-[^<]+)</code>", t)}
    assert searchable == reference_flags((DOCS / "reference" / "flags.md").read_text(encoding="utf-8"))
    assert {"--save-rollouts-max-mb", "--rollout-batch-size", "--vllm-max-model-len", "--lr"} <= searchable
    page = (tmp_path / "site" / "guides" / "debugging" / "index.html").read_text()
    assert "../../img/inspector.png" in page and (tmp_path / "site" / "img" / "inspector.png").is_file()


def test_every_bash_block_is_runnable_or_marked():
    blocks = bash_blocks()
    assert len(blocks) >= 10
    unmarked = [(page, body.splitlines()[0]) for page, body in blocks if not body.startswith(MARKERS)]
    assert not unmarked, f"bash blocks without {MARKERS}: {unmarked}"
    assert sum(body.startswith("# runnable") for _, body in blocks) >= 5


@pytest.fixture
def scratch(tmp_path, tiny_qwen3):
    """A working directory that looks like the repository root (its entry points linked in) and holds a saved run,
    outputs/my_run: one rollout of two samples, and a config.yaml naming the tiny model."""
    for name in ("train.py", "train_async.py", "scripts", "examples", "vime"):
        (tmp_path / name).symlink_to(REPO / name)
    run = tmp_path / "outputs" / "my_run"
    samples = [Sample(group_index=0, index=i, prompt="p", tokens=[5, 6, 7, 8 + i], response="r", response_length=2,
                      reward=float(i), loss_mask=[1, 0], rollout_log_probs=[-0.5, 0.0],
                      status=Sample.Status.COMPLETED) for i in range(2)]
    save_compact_rollout(run, "rollout_0", [samples], max_mb=1)
    (run / "config.yaml").write_text(f"hf-checkpoint: {tiny_qwen3}\n")
    return tmp_path


def test_runnable_bash_blocks_run(scratch):
    runnable = [(page, body) for page, body in bash_blocks() if body.startswith("# runnable")]
    home = scratch / "home"  # what the blocks write under ~ stays in the scratch directory
    home.mkdir()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), "HOME": str(home)}
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN"):  # the blocks set Ray's themselves
        env.pop(name, None)
    for page, body in runnable:
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", body], capture_output=True, text=True, timeout=300,
                              cwd=scratch, env=env)
        assert proc.returncode == 0, f"{page}:\n{body}\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    assert (scratch / "outputs" / "my_run" / "inspect" / "rollout_0.html").is_file()
    assert (scratch / "outputs" / "tiny_model" / "config.json").is_file()
    token = home / ".vime" / "ray_token"  # clusters.md: Ray's token, made as a new user would make it
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and stat.S_IMODE(token.parent.stat().st_mode) == 0o700
    assert re.fullmatch(r"[0-9a-f]{64}\n", token.read_text())
