"""Peak host memory of the log-prob + entropy computation over a real vocabulary, forward and backward, on this CPU:
the whole-block function (`_TargetLogProbs`, what 16-bit logits took before: a float32 copy of them, the softmax
kept for the backward) against the chunked one (`_ChunkedTargetLogProbs`: float32 only a chunk at a time, the
softmax recomputed in the backward), each in a fresh process, with the bare limit beside them: the logits and their
gradient alone.

    python bench/log_prob_memory.py [--rows 1024] [--vocab 151936]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r'''
import json, resource, sys
import torch
sys.path.insert(0, sys.argv[1])
from vime.trainer import log_probs as m
rows, vocab, variant, dtype = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], getattr(torch, sys.argv[5])
torch.manual_seed(0)
logits = torch.empty(rows, vocab, dtype=dtype)
for i in range(0, rows, 16):  # filled in small pieces: no float32 copy of the whole block raises the baseline
    logits[i:i + 16] = torch.randn(min(16, rows - i), vocab) * 2
logits.requires_grad_()
targets = torch.randint(0, vocab, (rows,))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if variant == "bare":  # the logits' gradient and nothing else
    grad = torch.empty_like(logits).fill_(1e-6)
elif variant == "whole":
    z = logits.float() / 0.8
    lp, ent = m._TargetLogProbs.apply(z, targets, True, True)
    (lp.sum() + ent.sum()).backward()
else:
    lp, ent = m._ChunkedTargetLogProbs.apply(logits, targets, 0.8, True, True, max(1, m.CHUNK_ELEMENTS // vocab))
    (lp.sum() + ent.sum()).backward()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"variant": variant, "dtype": sys.argv[5], "peak_mib_over_logits": round((peak - base) / 1024)}))
'''


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    a = p.parse_args(argv)
    rows = []
    for dtype in ("bfloat16", "float32"):
        for variant in ("bare", "whole", "chunked"):
            out = subprocess.run([sys.executable, "-c", CHILD, str(REPO), str(a.rows), str(a.vocab), variant, dtype],
                                 capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
        by = {r["variant"]: r["peak_mib_over_logits"] for r in rows if r["dtype"] == dtype}
        print(f"{dtype} logits {a.rows} x {a.vocab}: whole block {by['whole']} MiB, chunked {by['chunked']} MiB "
              f"({by['whole'] / max(by['chunked'], 1):.2f}x less), bare gradient {by['bare']} MiB", flush=True)
    return rows


if __name__ == "__main__":
    main()
