"""`python -m vime.inspect OUTPUT_DIR [--out DIR] [--tokenizer PATH]`: one HTML page per rollout a run kept in
OUTPUT_DIR/rollouts/ (and per eval set), plus index.html, written to OUTPUT_DIR/inspect/. Open index.html in a
browser; no server is needed."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path

from vime.config.run import JobConfig
from vime.inspect.load import (RolloutFileError, RolloutView, load_rollout_view, page_chunks, rollout_files, run_config,
                               run_metrics)
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


def make_private_dirs(path: Path) -> None:
    """Create `path` and its missing parents 0700 (the pages show a run's prompts and responses). A folder that
    exists is left as it is: --out may name a shared one."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        folder.mkdir(mode=0o700, exist_ok=True)


def write_private(path: Path, text: str) -> None:
    """Write `path` readable by its owner only (0600): a new file beside it, renamed over it, so that an older
    page's mode, or a link planted in its place, does not carry over."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mkstemp: 0600, whatever the umask
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


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
    make_private_dirs(out)
    views, skipped = [], 0
    for path in files:
        try:
            view = load_rollout_view(path, tokenizer, config.get("reward-key"), None)
        except RolloutFileError as e:  # a file vime did not write as it writes them: named, the others still shown
            print(f"vime.inspect: skipped {e}", file=sys.stderr)  # names the file, the line and the field
            skipped += 1
            continue
        row = metrics.get(view.rollout_id, {})
        view.metrics = row if view.eval_set is None else {k: v for k, v in row.items()
                                                          if k.startswith(f"eval/{view.eval_set}/")}
        for page in split_pages(view, args.max_page_tokens):
            write_private(out / f"{page.pages[page.page] if page.pages else view.name}.html", rollout_page(page))
        views.append(view)
    write_private(out / "index.html", index_page(str(output_dir), views))
    print(f"vime.inspect: {len(views)} rollout pages and {out / 'index.html'}"
          + (f"; {skipped} rollout files skipped (above)" if skipped else ""))
    return 1 if skipped else 0


if __name__ == "__main__":
    sys.exit(main())
