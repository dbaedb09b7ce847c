"""The manual runs: every example in README.md, docs/*.md and bench/README.md is executed or checked, the README stays
a few screens, links resolve, and the user guide names every public function, field, key and command.

How each fenced block is treated (the convention the docs follow):
- ```python: executed. A file's blocks run in document order in one Python process, in a fresh directory, after
  tests/python/docs_prelude.py (model, opt, make_batch, step, batch at small sizes); a failure names the file's line.
- ```sh: after the file's Python blocks, in the same directory, each line whose command is `python` (after any
  VAR=value assignments) runs under bash: the CLI, a script with GPUCAST_CONF. The directory holds train.py (a
  small loop that imports gpucast) and build/ (a link to the repository's build). Other commands (pip, make,
  cmake) are what CI itself and test_packaging run, and are not repeated here.
- ```cpp: a fragment of examples/cpp/, which ctest builds and runs: every line must appear there.
- ```text (or no language): output, not run.
- A block whose fence follows `<!-- not run: REASON -->` is skipped; the reason is required.
"""
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]
README_MAX_BYTES = 20 * 1024
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(.*?)\s*-->$")

TRAIN_PY = """\
import torch
import gpucast  # auto mode starts here when GPUCAST_CONF says enabled:True
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(3):
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
"""


def blocks(path: Path) -> list[dict]:
    """Fenced blocks: language, first line of the body (1-based), body, and the not-run reason (None: run)."""
    out, lines, i = [], path.read_text(encoding="utf-8").split("\n"), 0
    while i < len(lines):
        m = re.match(r"^\s*```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        prev = next((lines[k].strip() for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        reason = NOT_RUN.match(prev)
        j = i + 1
        while j < len(lines) and not re.match(r"^\s*```\s*$", lines[j]):
            j += 1
        assert j < len(lines), f"{path.name}:{i + 1}: a fence that is never closed"
        out.append({"lang": m.group(1), "line": i + 2, "body": textwrap.dedent("\n".join(lines[i + 1:j])),
                    "skip": reason.group(1) if reason else None})
        i = j + 1
    return out


def shell_commands(body: str) -> list[str]:
    """The lines of a sh block whose command is python, comments removed, continuation lines joined."""
    out = []
    for line in body.replace("\\\n", " ").split("\n"):
        words = shlex.split(line, comments=True)
        while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
            words = words[1:]
        if words and words[0] in ("python", "python3"):
            out.append(shlex.join(shlex.split(line, comments=True)))
    return out


def doc_id(p: Path) -> str:
    return str(p.relative_to(ROOT))


RUNNER = """\
import json, sys
blocks = json.load(open(sys.argv[1]))
g = {"__name__": "__main__"}
exec(compile(open(sys.argv[2]).read(), sys.argv[2], "exec"), g)
for b in blocks:
    exec(compile("\\n" * (b["line"] - 1) + b["body"], b["file"], "exec"), g)
"""


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_examples_run(doc: Path, tmp_path: Path) -> None:
    bs = [b for b in blocks(doc) if b["skip"] is None]
    py = [dict(b, file=str(doc)) for b in bs if b["lang"] == "python"]
    sh = [c for b in bs if b["lang"] in ("sh", "bash", "console") for c in shell_commands(b["body"])]
    if not py and not sh:
        pytest.skip(f"{doc_id(doc)} has no example to run")
    (tmp_path / "train.py").write_text(TRAIN_PY)
    (tmp_path / "build").symlink_to(ROOT / "build")
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'python'}{os.pathsep}{ROOT}",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("GPUCAST_CONF", None)
    env.pop("GPUCAST_LOG", None)
    if py:
        (tmp_path / "blocks.json").write_text(json.dumps(py))
        (tmp_path / "runner.py").write_text(RUNNER)
        r = subprocess.run([sys.executable, "runner.py", "blocks.json", str(ROOT / "tests/python/docs_prelude.py")],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{doc_id(doc)}'s Python examples failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    for c in sh:
        r = subprocess.run(["bash", "-c", c], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{doc_id(doc)}: `{c}` failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


def test_cpp_fragments_are_in_the_built_example() -> None:
    """A C++ fragment in the docs is a piece of examples/cpp/ (built and run under ctest), line by line."""
    def strip(line: str) -> str:
        return line.split("//")[0].strip()
    known = {strip(l) for f in (ROOT / "examples" / "cpp").rglob("*") if f.is_file()
             for l in f.read_text(encoding="utf-8", errors="replace").split("\n")}
    checked = 0
    for doc in DOCS:
        for b in blocks(doc):
            if b["lang"] != "cpp" or b["skip"] is not None:
                continue
            for n, line in enumerate(b["body"].split("\n")):
                assert not strip(line) or strip(line) in known, \
                    f"{doc_id(doc)}:{b['line'] + n}: `{strip(line)}` is not in examples/cpp/"
                checked += 1
    assert checked > 0, "no C++ fragment checked: the README's LibTorch example is gone"


def test_not_run_blocks_say_why() -> None:
    for doc in DOCS:
        for b in blocks(doc):
            assert b["skip"] is None or len(b["skip"]) >= 10, f"{doc_id(doc)}:{b['line']}: 'not run' needs a reason"


def test_every_python_block_is_run_or_says_why() -> None:
    """The main ways in stay executed: the README runs Python and CLI examples, the user guide too."""
    for doc in (ROOT / "README.md", ROOT / "docs" / "user-guide.md"):
        run = [b for b in blocks(doc) if b["skip"] is None]
        assert any(b["lang"] == "python" for b in run), f"{doc_id(doc)}: no Python example is run"
        assert any(shell_commands(b["body"]) for b in run if b["lang"] == "sh"), f"{doc_id(doc)}: no CLI line is run"


def test_readme_is_a_few_screens() -> None:
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_MAX_BYTES, f"README.md is {size:,} bytes, above {README_MAX_BYTES:,}: move reference to docs/"


def test_relative_links_resolve() -> None:
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            path = target.split("#")[0]
            assert (doc.parent / path).exists(), f"{doc_id(doc)} links to {target}, which does not exist"


def public_names() -> dict[str, list[str]]:
    import torch

    import gpucast
    from gpucast import _results
    names = {"gpucast.__all__": list(gpucast.__all__)}
    for cls in (gpucast.Trace, _results.Forecast, _results.MemoryForecast, _results.TimeForecast):
        fields = getattr(cls, "__dataclass_fields__", {})
        names[cls.__name__] = sorted({n for n in dir(cls) if not n.startswith("_")} | {n for n in fields if not n.startswith("_")})
    key = re.compile(r"^(\w+)\s", re.M)
    names["GPUCAST_CONF keys"] = key.findall(torch.ops.gpucast.auto_config_help())
    names["trace options"] = key.findall(gpucast.trace_options())
    names["CLI commands"] = re.findall(r'add_parser\("([\w-]+)"', (ROOT / "python/gpucast/__main__.py").read_text())
    return names


def test_user_guide_names_everything_public() -> None:
    guide = (ROOT / "docs" / "user-guide.md").read_text(encoding="utf-8")
    prose = re.sub(r"^\s*```.*?^\s*```\s*$", "", guide, flags=re.S | re.M)  # fenced blocks are not inline code
    quoted = " ".join(re.findall(r"`([^`\n]+)`", prose))
    missing = {what: [n for n in ns if not re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", quoted)]
               for what, ns in public_names().items()}
    missing = {k: v for k, v in missing.items() if v}
    assert not missing, f"docs/user-guide.md does not name (in backticks): {missing}"
    counts = {k: len(v) for k, v in public_names().items()}
    assert counts["GPUCAST_CONF keys"] >= 9 and counts["trace options"] >= 8 and counts["CLI commands"] >= 4, counts
