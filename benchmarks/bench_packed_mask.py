"""Peak memory of one packed forward pass with per-row attention, with and without transformers'
block-diagonal (1, 1, N, N) mask.

A packed pass holds N tokens of several rows in one sequence, position ids restarting per row
(no attention_mask): transformers' sdpa mask function then builds a boolean N x N block-diagonal
causal mask (N^2 bytes, plus its intermediates while it is built), which per-row attention
(trl_lite.models.packed_attention) never reads. `--mask materialized` registers transformers' own
sdpa mask function for the per-row attention, as trl_lite did before; `--mask deferred` keeps
trl_lite's, which hands the layers a recipe built only on demand. Both run the same forward pass
(a 2-layer GPT-2, 64 wide, rows of `--row-len` tokens, no grad) and must give the same logits.

Each mode runs in a fresh subprocess; its peak memory is the growth of the process's peak resident
set (ru_maxrss) over the resident set just before the forward pass.

Usage:
    python benchmarks/bench_packed_mask.py [--tokens 32768] [--row-len 512] [--threads 2]
"""

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
MODES = ("materialized", "deferred")
RESULT_MARKER = "BENCH_RESULT "


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def run_mode(mode: str, tokens: int, row_len: int) -> dict:
    """One packed forward pass of ``tokens`` tokens in rows of ``row_len``: time, peak memory growth,
    the mask the first attention layer received, and a checksum of the logits."""
    from transformers import AttentionInterface, GPT2Config, GPT2LMHeadModel
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from trl_lite.models import packed_attention

    if mode == "materialized":
        AttentionMaskInterface.register(packed_attention.PACKED_SDPA, sdpa_mask)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=512, n_positions=row_len, n_embd=64, n_layer=2, n_head=2)
    config._attn_implementation = "sdpa"
    model = GPT2LMHeadModel(config).eval()
    rows = tokens // row_len
    input_ids = torch.randint(0, config.vocab_size, (1, rows * row_len))
    position_ids = torch.arange(row_len).repeat(rows)[None]
    seen = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen.append(type(attention_mask).__name__ if attention_mask is not None else "None")
        return packed_attention.packed_sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(packed_attention.PACKED_SDPA, spy)
    before = _resident_bytes()
    start = time.perf_counter()
    with torch.no_grad(), packed_attention.attend_per_row([model]):
        hidden = model.transformer(
            input_ids=input_ids, position_ids=position_ids, use_cache=False,
            **{packed_attention.ROW_LENGTHS: (row_len,) * rows},
        ).last_hidden_state
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {
        "mode": mode, "tokens": rows * row_len, "rows": rows, "seconds": seconds,
        "peak_growth_bytes": max(0, peak - before), "checksum": float(hidden.double().sum()), "mask": seen[0],
    }  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32768, help="packed tokens per pass (rounded down to whole rows)")
    parser.add_argument("--row-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's own)")
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # a worker's one mode
    args = parser.parse_args(argv)
    if args.row_len < 1 or args.tokens < args.row_len:
        parser.error(f"--row-len must be >= 1 and --tokens >= --row-len, got {args.row_len} and {args.tokens}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.mode is not None:
        print(RESULT_MARKER + json.dumps(run_mode(args.mode, args.tokens, args.row_len)), flush=True)
        return
    results = []
    for mode in MODES:
        command = [sys.executable, __file__, "--mode", mode, "--tokens", str(args.tokens)]
        command += ["--row-len", str(args.row_len)] + (["--threads", str(args.threads)] if args.threads else [])
        out = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout
        line = next(line for line in out.splitlines() if line.startswith(RESULT_MARKER))
        results.append(json.loads(line[len(RESULT_MARKER) :]))
    if results[0]["checksum"] != results[1]["checksum"]:
        raise SystemExit(f"the two modes' hidden states differ: {results[0]['checksum']} != {results[1]['checksum']}")
    tokens, rows = results[0]["tokens"], results[0]["rows"]
    print(f"packed forward, {tokens} tokens in {rows} rows of {args.row_len}, GPT-2 2 x 64, no grad")
    print("| mask function | mask the layers get | peak memory growth (MiB) | time (s) |")
    print("|---|---|---:|---:|")
    for r in results:
        print(f"| {r['mode']} | {r['mask']} | {r['peak_growth_bytes'] / 2**20:.0f} | {r['seconds']:.2f} |")


if __name__ == "__main__":
    main()
