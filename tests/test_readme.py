"""README's Python examples run as written, at full size, and print what README says they print.

Each example is a ```python block after `<!-- example: NAME -->`; what it printed is the plain
``` block after `<!-- output: NAME -->`. What it printed on another machine sits in an HTML
comment, `<!-- output: NAME, on WHICH` + block + `-->`: 4-bit training and GPTQ turn the
CPU's last-bit float differences into other codes. Every example runs in a fresh interpreter
in an empty directory (the examples write runs/ and artifacts/ there), and must print one of
its recorded outputs: text exactly, numbers to a relative 1e-6. The quick start runs once, on
the package installed non-editable into a fresh venv (`scripts/check_install.sh`).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SCRIPTS  # tests/ is on sys.path (rootdir conftest)

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
_NUMBER = re.compile(r"-?\d+\.\d+(?:e[-+]?\d+)?")


def readme_examples(text: str) -> dict[str, tuple[str, list[str]]]:
    """{name: (code, printed outputs: the shown one first, then those of other machines)}
    of README's marked examples."""
    examples: dict[str, tuple[str, list[str]]] = {}
    for m in re.finditer(r"<!-- example: (\S+).*?-->\n```python\n(.*?)```", text, re.S):
        name = re.escape(m.group(1))
        shown = re.findall(rf"<!-- output: {name} -->\n```\n(.*?)```", text, re.S)
        others = re.findall(rf"<!-- output: {name}, [^\n]*\n```\n(.*?)```\n-->", text, re.S)
        examples[m.group(1)] = (m.group(2), shown + others)
    return examples


def same_output(got: str, want: str, rel: float = 1e-6) -> bool:
    """Equal line by line: the text between numbers exactly, the numbers to `rel`."""
    got_lines, want_lines = got.strip("\n").splitlines(), want.strip("\n").splitlines()
    if len(got_lines) != len(want_lines):
        return False
    for g, w in zip(got_lines, want_lines, strict=True):
        if _NUMBER.split(g) != _NUMBER.split(w):
            return False
        pairs = zip(_NUMBER.findall(g), _NUMBER.findall(w), strict=True)  # same split: same count
        if not all(math.isclose(float(a), float(b), rel_tol=rel) for a, b in pairs):
            return False
    return True


EXAMPLES = readme_examples(README.read_text())


def test_the_examples_are_found_and_each_has_its_output() -> None:
    assert set(EXAMPLES) == {"quick-start", "recipe"}
    recorded = {name: len(outs) for name, (_, outs) in EXAMPLES.items()}
    assert recorded == {"quick-start": 3, "recipe": 4}, EXAMPLES  # one per distinct print
    text = "<!-- example: x -->\n```python\npass\n```\n<!-- output: x -->\n```\na\n```\n"
    other = "<!-- output: x, elsewhere\n```\nb\n```\n-->\n"
    assert readme_examples(text) == {"x": ("pass\n", ["a\n"])}
    assert readme_examples(text + other) == {"x": ("pass\n", ["a\n", "b\n"])}


TEST_COMMAND = (
    "python3 -m venv .venv && . .venv/bin/activate && bash scripts/install.sh --test"
    " && python3 -m pytest -q -n 2"
)


def test_readme_is_a_short_manual_that_keeps_the_test_command() -> None:
    """README is the user's manual (at most 250 lines; the references live in docs/), and CI
    reads the test command from its line, which must stay byte for byte."""
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, len(lines)
    assert TEST_COMMAND in lines


def test_the_quick_start_imports_only_the_top_level_package() -> None:
    code, _ = EXAMPLES["quick-start"]
    imports = [line for line in code.splitlines() if line.startswith(("import ", "from "))]
    assert imports == ["from pathlib import Path", "import qnpu_jax as qj"], imports


def test_output_comparison_catches_a_changed_number_or_word() -> None:
    want = "plan: quantnpu W4A8KV8 29 tensors\nrun: 10.313888519433728\n"
    assert same_output("plan: quantnpu W4A8KV8 29 tensors\nrun: 10.31388852\n", want)
    assert not same_output("plan: quantnpu W4A8KV8 29 tensor paths\nrun: 10.313888519\n", want)
    assert not same_output("plan: quantnpu W4A8KV8 29 tensors\nrun: 10.197112661941082\n", want)
    assert not same_output("plan: quantnpu W4A8KV8 29 tensors\n", want)


def _assert_prints_what_readme_says(name: str, printed: str) -> None:
    recorded = EXAMPLES[name][1]
    assert any(same_output(printed, want) for want in recorded), (
        f"README's {name} example printed\n{printed}\nREADME records\n" + "\nor\n".join(recorded)
    )


# the quick start runs once, in the installed package's check below
@pytest.mark.parametrize("name", sorted(set(EXAMPLES) - {"quick-start"}))
def test_readme_example_prints_what_readme_says(name: str, tmp_path: Path) -> None:
    code, _ = EXAMPLES[name]
    (tmp_path / "example.py").write_text(code)
    done = subprocess.run(
        [sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=1500
    )
    assert done.returncode == 0, done.stderr[-4000:]
    _assert_prints_what_readme_says(name, done.stdout)


def test_installed_package_runs_the_quick_start_as_readme_says(tmp_path: Path) -> None:
    """scripts/check_install.sh: a plain `pip install .` into a fresh venv, used from another
    directory (shipped configs by name, the studies, a config-free run), then README's quick
    start as written, from an empty directory, on that installed copy; what it printed must
    be what README records."""
    printed = tmp_path / "quick_start.out"
    done = subprocess.run(
        ["bash", str(SCRIPTS / "check_install.sh"), str(printed)],
        env=dict(os.environ, PYTHON=sys.executable), capture_output=True, text=True,
        timeout=2400,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert "check_install: non-editable install" in done.stdout
    _assert_prints_what_readme_says("quick-start", printed.read_text())
