"""`--help` of every script in examples/ and benchmarks/, and of `python -m trl_lite.vllm_server`, prints
its usage and exits 0.

A script is a .py file there with an `if __name__ == "__main__":` block, or one that parses its
arguments at module level (the classic examples), so a new script is covered without editing this file. Every script would spend ~3 s importing torch, transformers and trl_lite
before parsing its flags; this file, run as a program, imports them once and then forks one child per
script, which runs it as `python <script> --help` would (its own argv, sys.path and exit status).
"""

import json
import os
import re
import runpy
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVER = "-m trl_lite.vllm_server"
CHILD_LIMIT_S = 120  # a script that ignores --help and starts training is stopped here
# A main block, or a parse_args call in a statement at module level.
SCRIPT = re.compile(r'^if __name__ == "__main__":|^\S.*parse_args', re.MULTILINE)


def discover() -> list[str]:
    """Every runnable script under examples/ and benchmarks/ (relative paths), then the server launcher."""
    scripts = sorted(
        str(path.relative_to(ROOT))
        for folder in ("examples", "benchmarks")
        for path in (ROOT / folder).rglob("*.py")
        if SCRIPT.search(path.read_text())
    )
    return [*scripts, SERVER]


def run_help(target: str) -> None:
    """In a forked child: run `target` with `--help` as `python <target>` (or `python -m`) would, then leave
    through the interpreter's own shutdown (exit handlers, finalization), as that process would."""
    signal.alarm(CHILD_LIMIT_S)
    code = 0
    try:
        if target.startswith("-m "):
            module = target.removeprefix("-m ")
            sys.argv = [module, "--help"]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, "--help"]
            sys.path.insert(0, str((ROOT / target).parent))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    raise SystemExit(code)  # unwinds the child out of `main` and shuts its interpreter down


def main(targets: list[str]) -> None:
    """Prints a JSON object: target -> {"returncode", "output"} of its `--help` run."""
    import torch  # noqa: F401  (imported once here, inherited by every child)
    import transformers  # noqa: F401

    import trl_lite  # noqa: F401

    results = {}
    for target in targets:
        with tempfile.TemporaryFile() as output:
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                os.dup2(output.fileno(), 1)
                os.dup2(output.fileno(), 2)
                run_help(target)
            _, status = os.waitpid(pid, 0)
            output.seek(0)
            text = output.read().decode(errors="replace")
        results[target] = {"returncode": os.waitstatus_to_exitcode(status), "output": text}
    json.dump(results, sys.stdout)


TARGETS = discover()


@pytest.fixture(scope="module")
def help_runs() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, __file__, *TARGETS], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=CHILD_LIMIT_S * 3,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def test_discovery_finds_the_scripts_of_every_folder():
    folders = {str(Path(target).parent) for target in TARGETS if target != SERVER}
    assert {"examples/scripts", "examples/classic", "examples/data", "benchmarks"} <= folders
    assert "examples/scripts/tiny_sentiment.py" not in TARGETS  # a module the scripts import, not a script


@pytest.mark.parametrize(
    "target", [pytest.param(t, marks=pytest.mark.requires("vllm")) if t == SERVER else t for t in TARGETS]
)
def test_help_prints_usage_and_exits_0(help_runs, target):
    run = help_runs[target]
    assert run["returncode"] == 0, run["output"][-4000:]
    assert "usage:" in run["output"], run["output"][-4000:]
    assert "Traceback" not in run["output"], run["output"][-4000:]


if __name__ == "__main__":
    main(sys.argv[1:])
