"""`--record_results FILE`: an example's printed results written to a markdown file (benchmarks/RESULTS.md) as a
section of its own, with what makes them reproducible: the command, the commit, the date, the machine and its
load. A later run of the same command replaces its section; other sections stay."""

import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def commit() -> str:
    """The checkout's commit, marked when files differ from it; 'unknown' outside a git checkout."""
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + (" with local changes" if dirty else "")


# Read when the script starts: the code that ran, whatever changes while it runs.
COMMIT_AT_START = commit()


def machine() -> str:
    cpu = platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if "model name" in line]
        cpu = names[0] if names else cpu
    return (f"{cpu}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}; Python "
            f"{platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}")


def record_run(path: str | Path, lines: list[str], load_at_start: str, seconds: float) -> None:
    """Replace (or append) the section of this command in the markdown file at `path` with `lines`."""
    script = Path(sys.argv[0]).name
    arguments, skip = [], False
    for argument in sys.argv[1:]:  # the command without --record_results itself
        if skip or argument.startswith("--record_results="):
            skip = False
            continue
        skip = argument == "--record_results"
        if not skip:
            arguments.append(argument)
    heading = f"## example: {script} {shlex.join(arguments)}".rstrip()
    body = "\n".join([
        heading, "",
        f"    python {Path(sys.argv[0]).as_posix()} {shlex.join(arguments)}".rstrip(), "",
        f"Machine: {machine()}; load average at start {load_at_start}, at end {load_average()}; commit {COMMIT_AT_START}; "
        f"{time.strftime('%Y-%m-%d')}; {seconds:.0f} s wall", "",
        *(f"    {line}" for line in lines), "",
    ])  # fmt: skip
    path = Path(path)
    text = path.read_text() if path.exists() else ""
    sections = text.split("\n## ")
    kept = [sections[0]] + ["## " + s for s in sections[1:] if not ("## " + s).startswith(heading + "\n")]
    path.write_text("\n".join(part.rstrip("\n") + "\n" for part in kept if part.strip()) + "\n" + body)
