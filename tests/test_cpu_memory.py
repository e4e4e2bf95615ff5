"""The glibc setting behind PPOConfig.keep_freed_cpu_memory, measured by the kernel's page-fault count."""

import json
import subprocess
import sys
from pathlib import Path


from trl_lite.trainer.memory.cpu_memory import keep_freed_cpu_memory

# Runs in a fresh interpreter: the setting is process-wide and must not leak into other tests.
# Like a mini-batch, each round allocates, touches and frees one and then three 20 MiB tensors
# (5,120 pages each). Under glibc's defaults most rounds get fresh pages from the kernel (tens of
# thousands of page faults over the run); once freed blocks are kept, the pages are reused.
CHILD = """
import json, resource, torch
from trl_lite.trainer.memory.cpu_memory import keep_freed_cpu_memory

def faults():
    total = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for alive in (1, 3) * 3:
        tensors = [torch.empty(5 << 20) for _ in range(alive)]
        for tensor in tensors:
            tensor.fill_(1.0)
        del tensors
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - total

before = faults()
applied = keep_freed_cpu_memory()
faults()  # the first round after the change still grows the heap once
print(json.dumps({"before": before, "applied": applied, "after": faults()}))
"""


def _transparent_huge_pages_always() -> bool:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.exists() and "[always]" in path.read_text()


def test_freed_cpu_memory_is_reused_without_page_faults():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["applied"] is True
    assert result["after"] < 100, result
    if not _transparent_huge_pages_always():  # 2 MiB pages would fault 512x less often to begin with
        assert result["before"] > 10_000, result


def test_returns_false_and_changes_nothing_without_glibc(monkeypatch):
    monkeypatch.setattr("platform.libc_ver", lambda *args, **kwargs: ("musl", "1.2"))
    assert keep_freed_cpu_memory() is False
