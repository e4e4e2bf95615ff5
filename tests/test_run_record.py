"""examples/scripts/run_record.py: `--record_results` writes a run's printed results with what reproduces them
(command, commit, date, machine, load), one section per command, replacing that command's earlier section."""

import re
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "examples" / "scripts"


def _record_run():
    sys.path.insert(0, str(SCRIPTS))
    try:
        import run_record
    finally:
        sys.path.remove(str(SCRIPTS))
    return run_record


def test_a_run_is_recorded_once_per_command_beside_the_other_sections(tmp_path, monkeypatch):
    run_record = _record_run()
    results = tmp_path / "RESULTS.md"
    results.write_text("# results\n\nWritten by scripts.\n\n## cpu fp32: w1\n\n| a | b |\n")
    command = ["examples/scripts/ppo_sentiment.py", "--steps", "3", "--record_results", str(results)]
    monkeypatch.setattr(sys, "argv", command)
    run_record.record_run(results, ["mean reward: first 1 steps +0.100, last 1 steps +0.200"], "1.50 1.25 1.00", 12.4)
    text = results.read_text()
    assert text.startswith("# results\n\nWritten by scripts.\n\n## cpu fp32: w1\n\n| a | b |\n")
    section = text.split("## example: ")[1]
    assert section.startswith("ppo_sentiment.py --steps 3\n")  # --record_results is not part of the command
    assert "    python examples/scripts/ppo_sentiment.py --steps 3\n" in section
    assert "load average at start 1.50 1.25 1.00, at end " in section and "; 12 s wall" in section
    assert re.search(r"commit (\w+|unknown)", section) and time.strftime("%Y-%m-%d") in section
    assert "torch threads" in section and "    mean reward: first 1 steps +0.100, last 1 steps +0.200" in section

    # The same command again replaces its section; another command gets its own.
    run_record.record_run(results, ["second"], "1.00 1.00 1.00", 3.0)
    monkeypatch.setattr(sys, "argv", ["examples/scripts/ppo_sentiment.py", f"--record_results={results}"])
    run_record.record_run(results, ["third"], "1.00 1.00 1.00", 3.0)
    text = results.read_text()
    assert text.count("## example: ppo_sentiment.py --steps 3\n") == 1 and "+0.100" not in text
    assert "    second" in text and "## example: ppo_sentiment.py\n" in text and "    third" in text
    assert text.count("## cpu fp32: w1") == 1
