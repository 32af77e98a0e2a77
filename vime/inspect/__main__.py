"""`python -m vime.inspect OUTPUT_DIR [--out DIR] [--tokenizer PATH]`: one HTML page per rollout a run kept in
OUTPUT_DIR/rollouts/ (and per eval set), plus index.html, written to OUTPUT_DIR/inspect/. Open index.html in a
browser; no server is needed."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from vime.config.run import JobConfig
from vime.inspect.load import RolloutView, load_rollout_view, page_chunks, rollout_files, run_config, run_metrics
from vime.inspect.render import index_page, rollout_page

DEFAULT_MAX_PAGE_TOKENS = 200_000  # ~18 MB of HTML: a browser still opens it in seconds


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m vime.inspect", description=__doc__.split("\n\n")[0])
    p.add_argument("output_dir", type=Path, help="a run's --output-dir")
    p.add_argument("--out", type=Path, default=None, help="where the pages go (default: OUTPUT_DIR/inspect)")
    p.add_argument("--max-page-tokens", type=int, default=DEFAULT_MAX_PAGE_TOKENS,
                   help="split a rollout over several pages of at most this many response tokens each (about 90 "
                        f"bytes of HTML a token; default {DEFAULT_MAX_PAGE_TOKENS})")
    p.add_argument("--tokenizer", default=None,
                   help="HF checkpoint whose tokenizer splits the tokens into text (default: the run's "
                        "--hf-checkpoint, from OUTPUT_DIR/config.yaml)")
    return p


def split_pages(view: RolloutView, max_tokens: int) -> list[RolloutView]:
    """The rollout's pages: itself, or, over `max_tokens` response tokens, one view per chunk of its samples
    (named <name>.html, <name>.2.html, ...; each links to the others)."""
    chunks = page_chunks([s.raw.get("response_length") or 0 for s in view.samples], max_tokens)
    if len(chunks) == 1:
        return [view]
    view.pages = [view.name] + [f"{view.name}.{k}" for k in range(2, len(chunks) + 1)]
    return [dataclasses.replace(view, samples=view.samples[c.start:c.stop], page=k) for k, c in enumerate(chunks)]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    job = JobConfig.of(args)
    output_dir: Path = job.output_dir
    files = rollout_files(output_dir)
    if not files:
        print(f"vime.inspect: no rollouts in {output_dir / 'rollouts'} (a run keeps them there unless "
              "--no-save-rollouts)", file=sys.stderr)
        return 1
    config = run_config(output_dir)
    tokenizer_path = args.tokenizer or config.get("hf-checkpoint")
    if not tokenizer_path:
        print(f"vime.inspect: {output_dir / 'config.yaml'} names no hf-checkpoint; pass --tokenizer PATH",
              file=sys.stderr)
        return 1
    from vime.utils.hf_tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_path)
    metrics = run_metrics(output_dir)
    out = args.out or output_dir / "inspect"
    out.mkdir(parents=True, exist_ok=True)
    views = []
    for path in files:
        view = load_rollout_view(path, tokenizer, config.get("reward-key"), None)
        row = metrics.get(view.rollout_id, {})
        view.metrics = row if view.eval_set is None else {k: v for k, v in row.items()
                                                          if k.startswith(f"eval/{view.eval_set}/")}
        for page in split_pages(view, args.max_page_tokens):
            (out / f"{page.pages[page.page] if page.pages else view.name}.html").write_text(rollout_page(page),
                                                                                            encoding="utf-8")
        views.append(view)
    (out / "index.html").write_text(index_page(str(output_dir), views), encoding="utf-8")
    print(f"vime.inspect: {len(views)} rollout pages and {out / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
