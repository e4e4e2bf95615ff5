"""What the docs name exists, and their Python runs (issue 61).

Every page found at test time is read: README.md, every `docs/*.md`, `examples/README.md`, `benchmarks/README.md`
and `benchmarks/*.md` (a page added later is checked without touching this file). In each, backticked text is read
as a reference where it has one of these shapes, and must resolve:

- a repository path (`trl_lite/trainer/step/forward.py`, `docs/algorithm.md`, `tests/test_core.py`, `benchmarks/`);
- a module or name of the package (`trl_lite.trainer.memory.prefix_sharing.epoch_order`, `trl_lite.extras.DynamicSampler(...)`);
- an attribute of the public classes (`PPOConfig.lm_head_chunk_size`, `PPOConfig(lm_head_chunk_size=...)`,
  `PPOTrainer._logits_out`);
- a name of a script (`bench_step.tensor_peak_mb`: a function, class or variable that `benchmarks/bench_step.py` defines);
- a flag of a script, in a command that runs it (`python examples/scripts/ppo.py --reward_model ...`).

Each relative link of `examples/*.md` and `benchmarks/*.md` resolves, its #anchor included (tests/test_docs_links.py
checks README.md and docs/ the same way).

No page names a path outside the repository (an absolute path, `~/...`, a `gpu-runs/` folder of one machine).

Every fenced ```python block of the front door (README.md) and of the migration pages (docs/migrating_from_*.md)
runs, offline, in a fresh interpreter, unless an HTML comment on the line before it marks it as an excerpt:

    <!-- excerpt -->                       (a fragment of a larger program)
    <!-- excerpt: my_prompts, my_reward --> (it uses these names, which the reader supplies)

An excerpt must still compile and use only names it imports or assigns, builtins, or the names its marker lists.
"""

import ast
import builtins
import dataclasses
import os
import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _pages() -> list[Path]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*.md")),
             *sorted((ROOT / "benchmarks").glob("*.md"))]
    return [page for page in pages if page.is_file()]


PAGES = _pages()
RUNNABLE_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("migrating_from_*.md"))]


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def _fenced_blocks(text: str):
    """(language, code, the line before the opening fence) of every fenced block."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = re.match(r"\s*```(\w*)", lines[i])
        if opening:
            start = i
            i += 1
            body = []
            while i < len(lines) and not lines[i].strip().startswith("```"):
                body.append(lines[i])
                i += 1
            before = lines[start - 1].strip() if start else ""
            yield opening.group(1), "\n".join(body), before
        i += 1


def _prose_and_inline(text: str) -> list[str]:
    """Every inline `code` span outside fenced blocks."""
    without_fences = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.findall(r"(?<!`)`([^`\n]+)`(?!`)", without_fences)


# ---------------------------------------------------------------------------------------------------- paths

TOP_FOLDERS = ("trl_lite", "tests", "docs", "examples", "benchmarks", "scripts", "accelerate_configs", ".ci")
TOP_FILES = ("README.md", "Makefile", "setup.cfg", "pyproject.toml")
# Paths that runs write (outputs, logs), not files of the repository.
WRITTEN_BY_RUNS = ("outputs/", "runs/", "tuned/", "checkpoints/", "benchmarks/results/", ".venv/")
PATH = re.compile(r"^(?:\./)?((?:%s)(?:/[\w.*-]*)*/?|[\w-]+\.(?:md|cfg|toml))$" % "|".join(
    re.escape(folder) for folder in TOP_FOLDERS))


def _ours(text: str) -> str:
    """The text without what names classic TRL's own files: a line that says "classic TRL", a table column headed
    "Classic ..." (a path there is classic TRL's repository's, not this one's)."""
    kept, classic_columns = [], set()
    for line in text.splitlines():
        if re.search(r"classic TRL", line, flags=re.I):
            continue
        if line.startswith("|"):
            cells = line.split("|")
            if any(re.match(r"\s*classic", cell, flags=re.I) for cell in cells) and not line.startswith("| ---"):
                classic_columns = {i for i, cell in enumerate(cells) if re.match(r"\s*classic", cell, flags=re.I)}
                continue
            line = "|".join(cell for i, cell in enumerate(cells) if i not in classic_columns)
        else:
            classic_columns = set()
        kept.append(line)
    return "\n".join(kept)


def _path_refs(page: Path) -> set[str]:
    refs = set()
    for span in _prose_and_inline(_ours(_text(page))):
        for word in span.split():
            match = PATH.match(word.rstrip(",.:;)"))
            if match and ("/" in match.group(1) or match.group(1) in TOP_FILES):
                refs.add(match.group(1))
    return refs


def _path_exists(page: Path, ref: str) -> bool:
    if ref.startswith(WRITTEN_BY_RUNS) or "*" in ref:
        return "*" not in ref or any(ROOT.glob(ref))
    return (ROOT / ref).exists() or (page.parent / ref).exists()


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_backticked_path_exists(page):
    missing = sorted(ref for ref in _path_refs(page) if not _path_exists(page, ref))
    assert not missing, f"{_page_id(page)} names paths that are not in the repository: {missing}"


OUTSIDE = re.compile(r"(?<![\w.~-])(/work/|/home/|/tmp/|/opt/|~/|gpu-runs/)[^\s`)]*")


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_no_page_names_a_path_outside_the_repository(page):
    found = sorted({m.group(0) for m in OUTSIDE.finditer(_text(page))})
    assert not found, f"{_page_id(page)} names paths of one machine, outside the repository: {found}"


# ---------------------------------------------------------------------------------- trl_lite names, attributes

DOTTED = re.compile(r"^(trl_lite(?:\.\w+)+)(?:\(.*\))?$")


def _resolve(dotted: str) -> bool:
    """True when `dotted` is an importable module of trl_lite or a name defined in one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module_path = ROOT.joinpath(*parts[:cut])
        if module_path.with_suffix(".py").is_file() or (module_path / "__init__.py").is_file():
            rest = parts[cut:]
            if not rest:
                return True
            import importlib

            obj = importlib.import_module(".".join(parts[:cut]))
            for name in rest:
                if not hasattr(obj, name):
                    return False
                obj = getattr(obj, name)
            return True
    return False


def _trl_lite_refs(page: Path) -> set[str]:
    refs = set()
    for span in _prose_and_inline(_text(page)):
        match = DOTTED.match(span.strip())
        if match:
            refs.add(match.group(1))
    return refs


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_trl_lite_name_exists(page):
    missing = sorted(ref for ref in _trl_lite_refs(page) if not _resolve(ref))
    assert not missing, f"{_page_id(page)} names modules or names that trl_lite does not have: {missing}"


@lru_cache(maxsize=None)
def _assigned_self_attributes(folder: str) -> frozenset[str]:
    """Every `self.name = ...` (and annotated form) in the Python files under `folder`."""
    names = set()
    for file in (ROOT / folder).rglob("*.py"):
        names.update(re.findall(r"\bself\.(\w+)\s*(?::[^=\n]+)?=(?!=)", file.read_text(encoding="utf-8")))
    return frozenset(names)


def _config_fields() -> set[str]:
    from trl_lite import PPOConfig

    return {field.name for field in dataclasses.fields(PPOConfig)} | set(dir(PPOConfig))


def _attribute_refs(page: Path) -> set[tuple[str, str]]:
    refs = set()
    for span in _prose_and_inline(_text(page)):
        for owner, name in re.findall(r"(?<![\w.])(PPOConfig|PPOTrainer)\.(\w+)", span):
            refs.add((owner, name))
        for kwargs in re.findall(r"(?<![\w.])PPOConfig\(([^()]*)\)", span):
            refs.update(("PPOConfig", name) for name in re.findall(r"(\w+)\s*=", kwargs))
    return refs


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_ppo_config_and_trainer_attribute_exists(page):
    from trl_lite import PPOTrainer

    fields = _config_fields()
    trainer_names = set(dir(PPOTrainer)) | _assigned_self_attributes("trl_lite/trainer")
    missing = sorted(
        f"{owner}.{name}"
        for owner, name in _attribute_refs(page)
        if name not in (fields if owner == "PPOConfig" else trainer_names)
    )
    assert not missing, f"{_page_id(page)} names attributes that do not exist: {missing}"


# ------------------------------------------------------------------------------------------- scripts' names

SCRIPT_FOLDERS = ("benchmarks", "examples/scripts", "examples/classic", "scripts")
FILE_SUFFIXES = ("py", "md", "png", "yaml", "json", "jsonl", "sh", "ipynb", "txt", "cfg", "toml", "gguf")


def _script(stem: str) -> Path | None:
    for folder in SCRIPT_FOLDERS:
        for candidate in (ROOT / folder).rglob(f"{stem}.py"):
            return candidate
    return None


def _defines(source: str, name: str) -> bool:
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id == name:
            return True
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return True
        if isinstance(node, ast.alias) and (node.asname or node.name) == name:
            return True
    return False


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_script_name_exists(page):
    missing = []
    for span in _prose_and_inline(_text(page)):
        match = re.fullmatch(r"(\w+)\.(\w+)(?:\(.*\))?", span.strip())
        if not match or match.group(2) in FILE_SUFFIXES:
            continue
        script = _script(match.group(1))
        if script is not None and not _defines(script.read_text(encoding="utf-8"), match.group(2)):
            missing.append(f"{match.group(1)}.{match.group(2)} (not in {script.relative_to(ROOT)})")
    assert not missing, f"{_page_id(page)} names what the scripts do not define: {sorted(set(missing))}"


# --------------------------------------------------------------------------------------------- scripts' flags

COMMAND = re.compile(r"(?:python3?|accelerate launch(?: --?[\w-]+(?:[ =][^\s-][^\s]*)?)*|torchrun[^\n`]*?)\s+"
                     r"((?:examples|benchmarks|scripts)/[\w/.-]+\.py)((?:[ \t]+(?:\\\n)?[^\n`|;&]*)*)")


@lru_cache(maxsize=None)
def _flags_of(script: Path) -> frozenset[str]:
    """The flags a script accepts, read from its source and the argument dataclasses it parses.

    argparse's `"--name"` literals, the fields of the dataclasses the script (or a helper module of its folder)
    defines for HfArgumentParser, and PPOConfig's (GRPOConfig's, RLOOConfig's) fields where the script parses it."""
    sources = [script.read_text(encoding="utf-8")]
    for module in re.findall(r"^(?:from|import) (\w+)", sources[0], flags=re.M):
        sibling = script.parent / f"{module}.py"
        if sibling.is_file():
            sources.append(sibling.read_text(encoding="utf-8"))
    flags = set()
    for source in sources:
        flags.update(re.findall(r"[\"'](--[\w-]+)[\"']", source))
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(
                isinstance(d, ast.Name) and d.id == "dataclass" or isinstance(d, ast.Call) and getattr(d.func, "id", "") == "dataclass"
                for d in node.decorator_list
            ):
                flags.update(f"--{item.target.id}" for item in node.body
                             if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name))
        if re.search(r"HfArgumentParser\([^)]*PPOConfig", source):
            flags.update(f"--{name}" for name in _config_fields())
        for parsed in re.findall(r"HfArgumentParser\([^)]*\b(GRPOConfig|RLOOConfig)\b", source):
            import trl_lite

            flags.update(f"--{field.name}" for field in dataclasses.fields(getattr(trl_lite, parsed)))
    flags.update({"--help", "-h"})
    return frozenset(flags)


def _commands(text: str):
    for match in COMMAND.finditer(text):
        yield match.group(1), match.group(2)


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_flag_of_a_quoted_command_is_a_flag_of_its_script(page):
    unknown = []
    for script_name, arguments in _commands(_text(page)):
        script = ROOT / script_name
        if not script.is_file():
            continue  # test_docs_links reports the missing script
        accepted = _flags_of(script)
        for flag in re.findall(r"(?<![\w-])(--[A-Za-z][\w-]*)", arguments):
            if flag not in accepted:
                unknown.append(f"{script_name} {flag}")
    assert not unknown, f"{_page_id(page)} quotes flags its scripts do not take: {sorted(set(unknown))}"


# ------------------------------------------------------------------------------------------- Python blocks

EXCERPT = re.compile(r"<!--\s*excerpt(?::\s*([\w,\s]*))?\s*-->")


def _python_blocks(page: Path):
    for language, code, before in _fenced_blocks(_text(page)):
        if language in ("python", "py"):
            yield code, EXCERPT.fullmatch(before)


def _undefined_names(code: str, given: set[str]) -> set[str]:
    """Names the code reads but never imports, assigns or receives (a coarse, scope-free check)."""
    tree = ast.parse(code)
    bound = set(given) | set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    read = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    return read - bound


def _block_ids():
    ids, blocks = [], []
    for page in RUNNABLE_PAGES:
        for index, (code, excerpt) in enumerate(_python_blocks(page)):
            ids.append(f"{_page_id(page)}[{index}]")
            blocks.append((code, excerpt))
    return ids, blocks


BLOCK_IDS, BLOCKS = _block_ids()


@pytest.mark.parametrize("block", BLOCKS, ids=BLOCK_IDS)
def test_every_python_block_runs_or_is_a_self_consistent_excerpt(block):
    code, excerpt = block
    if excerpt is not None:
        given = {name.strip() for name in (excerpt.group(1) or "").split(",") if name.strip()}
        compile(code, "<excerpt>", "exec")
        undefined = _undefined_names(code, given)
        assert not undefined, f"an excerpt uses names it neither defines nor lists in its marker: {sorted(undefined)}"
        return
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"the block fails:\n{code}\n--- stderr ---\n{done.stderr[-3000:]}"


def test_the_checks_find_what_they_look_for():
    """Each check, fed a page with one wrong name of each kind, reports it (the patterns are not vacuous)."""
    page = ROOT / "docs" / "_probe.md"
    text = ("`trl_lite/no_such_file.py` `trl_lite.no_such_module` `PPOTrainer._no_such_attribute` "
            "`PPOConfig.no_such_field` `bench_step.no_such_name` /work/shared/x.md\n\n"
            "```bash\npython examples/scripts/ppo_sentiment.py --no_such_flag 1\n```\n\n"
            "<!-- excerpt -->\n```python\nprint(undefined_name)\n```\n")
    page.write_text(text)
    try:
        assert "trl_lite/no_such_file.py" in _path_refs(page)
        assert not _resolve("trl_lite.no_such_module") and _resolve("trl_lite.extras.DynamicSampler")
        assert ("PPOTrainer", "_no_such_attribute") in _attribute_refs(page)
        assert "no_such_field" not in _config_fields() and "lm_head_chunk_size" in _config_fields()
        assert not _defines((ROOT / "benchmarks" / "bench_step.py").read_text(), "no_such_name")
        assert OUTSIDE.search(text)
        [(script, arguments)] = list(_commands(text))
        assert "--no_such_flag" not in _flags_of(ROOT / script) and "--model_name" in _flags_of(ROOT / script)
        [(code, excerpt)] = list(_python_blocks(page))
        assert excerpt is not None and _undefined_names(code, set()) == {"undefined_name"}
    finally:
        page.unlink()
