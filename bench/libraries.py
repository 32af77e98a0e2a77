"""Hand-written code against the libraries that could replace it, side by side in one process:

- the rollout wire codec (`vime.data.sample_codec`: msgspec MessagePack, a CRC32 and the Sample checks; no pickle)
  against bare msgspec MessagePack of the same sample dicts, and against that plus a CRC32 and `check_sample_dict`
  per sample (the lower bound of a codec with the same checks), encode + decode of one rollout;
- building and type-checking the run's typed config (`RunConfig.build`, dataclasses) against a pydantic model
  of the same typed fields, validating the same parsed flags; and the import time of each library.

    .venv/bin/python bench/libraries.py [--samples 1000 --tokens 1024 --repeats 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def codec(samples: int, tokens: int, repeats: int) -> None:
    import msgspec

    from bench.buffer import make_rollout
    from vime.data.sample_codec import decode_rollout, encode_rollout
    from vime.data.sample import check_sample_dict

    groups = make_rollout(0, samples, tokens)
    ours = best_of(lambda: decode_rollout(encode_rollout(groups)), repeats)
    packed = msgspec.msgpack.encode(groups)
    theirs = best_of(lambda: msgspec.msgpack.decode(msgspec.msgpack.encode(groups)), repeats)

    def msgspec_checked():  # what the codec also does: a CRC of the payload and the Sample contract on decode
        data = msgspec.msgpack.encode(groups)
        zlib.crc32(data)
        for group in msgspec.msgpack.decode(data):
            for sample in group:
                check_sample_dict(sample)

    checked = best_of(msgspec_checked, repeats)
    print(f"codec  vime sample_codec {ours * 1e3:7.1f} ms   msgspec msgpack {theirs * 1e3:7.1f} ms "
          f"(+ CRC and Sample checks {checked * 1e3:7.1f} ms)   ratio vime/msgspec {ours / theirs:.2f} "
          f"({ours / checked:.2f} checked)   sizes {len(encode_rollout(groups)) / 1e6:.1f} MB / "
          f"{len(packed) / 1e6:.1f} MB")


def config(repeats: int) -> None:
    import typing

    import pydantic

    from vime.arguments import parse_args, run_config
    from vime.config import RunConfig
    from vime.synthetic.arithmetic_data import write_arithmetic_data
    from vime.synthetic.tiny_model import build_tiny_model

    work = Path(tempfile.mkdtemp())
    data, _ = write_arithmetic_data(work / "data", n_train=8, n_eval=2, seed=0)
    args = parse_args(["--hf-checkpoint", str(build_tiny_model(work / "model", arch="qwen3", seed=0)),
                       "--prompt-data", str(data), "--rm-type", "math", "--output-dir", str(work / "out")],
                      check_model=False)
    models = {}
    for name, section in RunConfig.sections().items():
        hints = typing.get_type_hints(section)
        fields = {f.name: (hints[f.name], None) for f in dataclasses.fields(section)}
        models[name] = pydantic.create_model(section.__name__, __config__=pydantic.ConfigDict(frozen=True, strict=True),
                                             **fields)
    values = vars(args)

    def with_pydantic():
        for name, model in models.items():
            model(**{f: values[f] for f in model.model_fields if f in values})

    ours = statistics.median([best_of(lambda: run_config(args), 1) for _ in range(repeats * 20)])
    theirs = statistics.median([best_of(with_pydantic, 1) for _ in range(repeats * 20)])
    print(f"config RunConfig.build {ours * 1e3:6.2f} ms   pydantic (strict, frozen) {theirs * 1e3:6.2f} ms   "
          f"ratio {ours / theirs:.2f}")
    for module in ("dataclasses", "msgspec", "pydantic"):
        out = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"], capture_output=True,
                             text=True).stderr.strip().splitlines()[-1]
        print(f"import {module}: {int(out.split('|')[1]) / 1e3:.1f} ms cumulative")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    codec(args.samples, args.tokens, args.repeats)
    config(args.repeats)


if __name__ == "__main__":
    main()
