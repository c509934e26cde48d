"""The documentation's links and commands.

Every relative link in README.md, CONTRIBUTING.md, docs/*.md (any page added there later too) and
benchmarks/README.md must lead to a file or folder of the repository, and its `#anchor`, if it
has one, to a heading (GitHub's slug) or an `<a id>` of that page. Every command in a fenced
`bash` block of those pages must name something that exists: an entry point of pyproject.toml's
[project.scripts], a module for `python -m`, a script of the repository, or a standard tool
(python3, pip, pytest, torchrun, git, bash, ...). A command of this repository (an entry point,
`python -m fastlm...`, `python benchmarks/x.py`, the same under torchrun) may pass only the
`--flags` its argparse parser has. The parsers are built, not run: one subprocess imports each
command with `ArgumentParser.parse_known_args` stubbed to hand back the parser it was called on.
"""

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parent.parent


def pages(root: Path = REPO) -> list[Path]:
    """The pages checked: found anew each run, so a new docs/*.md is checked with no change here."""
    found = [root / "README.md", root / "CONTRIBUTING.md", root / "benchmarks" / "README.md"]
    found += sorted((root / "docs").rglob("*.md"))
    return [page for page in found if page.is_file()]


# --------------------------------------------------------------------------------------------
# Markdown: code, headings, links
# --------------------------------------------------------------------------------------------

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([\w+-]*)")


def fenced_blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """(first line number, info word, lines) of each fenced code block."""
    blocks, lines, open_fence = [], text.split("\n"), None
    for number, line in enumerate(lines, 1):
        match = FENCE.match(line)
        if open_fence is None and match:
            open_fence, start, info, body = match.group(1), number + 1, match.group(2), []
        elif open_fence is not None and re.fullmatch(rf" {{0,3}}{open_fence}+\s*", line):
            blocks.append((start, info.lower(), body))
            open_fence = None
        elif open_fence is not None:
            body.append(line)
    return blocks


def without_fences(text: str) -> str:
    """`text` with its fenced code blocks blanked, fences included (line numbers kept)."""
    lines = text.split("\n")
    for start, _, body in fenced_blocks(text):
        for i in range(start - 2, min(start + len(body), len(lines))):
            lines[i] = ""
    return "\n".join(lines)


def prose(text: str) -> str:
    """`text` with code blocks and inline code spans blanked (offsets kept): what looks like a
    link inside code is none."""
    return re.sub(r"(`+)(.+?)\1", lambda m: " " * len(m.group(0)), without_fences(text), flags=re.S)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its rendered text lowercased, punctuation other than
    '-' and '_' dropped, each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every #anchor a page has: its headings' slugs (a repeated one gets -1, -2, ... as on
    GitHub) and the ids and names of its HTML anchors."""
    found, seen = set(), {}
    for line in without_fences(text).split("\n"):
        match = re.match(r"^ {0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*$", line)
        if match:
            slug = github_slug(match.group(1))
            found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    found.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", text))
    return found


LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every inline link, image and reference definition."""
    text = prose(text)
    found = sorted(
        (m for pattern in (LINK, REFERENCE) for m in pattern.finditer(text)),
        key=lambda m: m.start(),
    )
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in found]


def exists_as_spelled(path: Path, root: Path) -> bool:
    """Whether `path` (under `root`) exists with every name spelled as its folder lists it:
    GitHub's links are case-sensitive even where the file system is not."""
    for part in [path, *path.parents]:
        if part == root:
            return True
        if not part.parent.is_dir() or part.name not in os.listdir(part.parent):
            return False
    return False


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    """'page:line: target: why' for each relative link of `page` that does not resolve."""
    text, problems = page.read_text(), []
    for line, target in links(text):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # https:, mailto:: not ours to check
            continue
        path, _, anchor = unquote(target.split("?")[0]).partition("#")
        where = f"{page.relative_to(root)}:{line}: {target}"
        resolved = (page.parent / path).resolve() if path else page.resolve()
        if root.resolve() not in [resolved, *resolved.parents]:
            problems.append(f"{where}: leads out of the repository")
        elif not exists_as_spelled(resolved, root.resolve()):
            problems.append(f"{where}: no such file or folder")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text()):
            problems.append(f"{where}: {resolved.name} has no heading or anchor #{anchor}")
        elif not target:
            problems.append(f"{where}: an empty link")
    return problems


# --------------------------------------------------------------------------------------------
# Commands in bash blocks
# --------------------------------------------------------------------------------------------

#: Commands that are not this repository's: only their existence is taken for granted.
STANDARD_TOOLS = set(
    ". source bash sh cd export env nice time timeout python python3 pip pip3 pytest torchrun "
    "git ruff yapf pre-commit tar unzip grep sed head tail diff rm mkdir cp mv ls cat echo "
    "nvidia-smi nproc tensorboard".split()
)
PYTHONS = {"python", "python3"}
OPERATORS = {"&&", "||", ";", "|", "&", "(", ")"}
REDIRECTS = {">", ">>", "<", ">&", "&>"}


def project_scripts(root: Path = REPO) -> dict[str, str]:
    """pyproject.toml's [project.scripts]: command -> "module:function"."""
    section = re.search(
        r"^\[project\.scripts\]\n(.*?)(?=^\[|\Z)",
        (root / "pyproject.toml").read_text(),
        re.M | re.S,
    )
    return dict(
        re.findall(r'^\s*([\w.-]+)\s*=\s*"([^"]+)"', section.group(1) if section else "", re.M)
    )


def bash_commands(text: str) -> list[tuple[int, list[str]]]:
    """(line number, argv) of each simple command in the page's bash blocks: continuation
    lines joined, comments dropped, split at && || ; | and redirections left out."""
    commands = []
    for start, info, body in fenced_blocks(text):
        if info not in ("bash", "sh", "shell"):
            continue
        logical, first = "", None
        for number, line in enumerate(body, start):
            first = number if first is None else first
            if line.rstrip().endswith("\\"):
                logical += line.rstrip()[:-1] + " "
                continue
            lexer = shlex.shlex(logical + line, posix=True, punctuation_chars=True)
            lexer.whitespace_split, lexer.commenters = True, "#"
            argv, skip = [], False
            for token in list(lexer) + [";"]:
                if skip:
                    skip = False
                elif token in REDIRECTS:
                    skip = True
                elif token in OPERATORS:
                    if argv:
                        commands.append((first, argv))
                    argv = []
                else:
                    argv.append(token)
            logical, first = "", None
    return commands


def command_target(argv: list[str], scripts: dict[str, str], root: Path = REPO):
    """(what `argv` runs, the arguments it passes): the first is ("entry" | "module" | "script",
    name) for a command of this repository, whose flags are checked, None for any other that
    exists (a standard tool, an installed module, a shell script), or a string saying what is
    wrong."""
    while argv and re.match(r"^[A-Za-z_]\w*=", argv[0]):  # VAR=value before the command
        argv = argv[1:]
    if argv[:1] == ["nice"] and argv[1:2] == ["-n"]:
        argv = argv[3:]
    command, rest = argv[0], argv[1:]
    if command in scripts:
        return ("entry", scripts[command]), rest
    if command in PYTHONS or command == "torchrun":
        for i, token in enumerate(rest):
            if rest[i - 1 : i] in (["-X"], ["-W"]):  # an interpreter option's value
                continue
            if token == "-m" and i + 1 < len(rest):
                return _module_target(rest[i + 1], root), rest[i + 2 :]
            if token == "-c":
                return None, []
            if token.endswith(".py") or (command in PYTHONS and not token.startswith("-")):
                return _script_target(token, root), rest[i + 1 :]
        return f"{command} names no module or script", []
    if command in ("bash", "sh"):
        script = next((token for token in rest if not token.startswith("-")), None)
        return (None if script is None else _script_target(script, root)), []
    if "/" in command:
        return _script_target(command, root), rest
    if command in STANDARD_TOOLS:
        return None, []
    return (
        f"{command}: not an entry point of pyproject.toml, a script here, nor a standard tool",
        [],
    )


def _module_target(module: str, root: Path):
    """A module of this repository (its flags checked) or one that is installed."""
    if (root / module.split(".")[0]).is_dir():
        parts = module.split(".")
        if (root.joinpath(*parts).with_suffix(".py")).is_file():
            return ("module", module)
        if (root.joinpath(*parts) / "__main__.py").is_file():
            return ("module", module)
        return f"python -m {module}: no such module in the repository"
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return f"python -m {module}: not installed"
    return None


def _script_target(path: str, root: Path):
    """A script of this repository, by its path from the repository's root."""
    if (root / path).is_file():
        return ("script", path) if path.endswith(".py") else None
    return f"{path}: no such script in the repository"


#: Run in a subprocess: import each command with parse_known_args stubbed, and print the option
#: strings of the parser it builds (and of each subcommand's) as JSON.
CAPTURE = r"""
import argparse, importlib, json, os, runpy, sys
from pathlib import Path


class Captured(BaseException):
    def __init__(self, parser):
        self.parser = parser


def capture(self, args=None, namespace=None):
    raise Captured(self)


def options(parser):
    found, sub = [], {}
    for action in parser._actions:
        found += action.option_strings
        if isinstance(action, argparse._SubParsersAction):
            sub = {name: options(p)[0] for name, p in action.choices.items()}
    return found, sub


argparse.ArgumentParser.parse_known_args = argparse.ArgumentParser.parse_args = capture
result = {}
for kind, name in json.loads(sys.argv[1]):
    sys.argv = [name]
    path, environment = sys.path[:], dict(os.environ)  # what one script sets is not the next's
    try:
        if kind == "entry":
            module, function = name.split(":")
            getattr(importlib.import_module(module), function)()
        elif kind == "module":
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, str(Path(name).resolve().parent))
            runpy.run_path(name, run_name="__main__")
        result[f"{kind} {name}"] = {"error": "it ran without building an argparse parser"}
    except Captured as captured:
        found, sub = options(captured.parser)
        result[f"{kind} {name}"] = {"options": found, "subcommands": sub}
    except BaseException as error:
        result[f"{kind} {name}"] = {"error": f"{type(error).__name__}: {error}"}
    finally:
        sys.path[:] = path
        os.environ.clear()
        os.environ.update(environment)
print("\n" + json.dumps(result))
"""

_PARSERS: dict[str, dict] = {}


def parsers(targets: set[tuple[str, str]]) -> dict[str, dict]:
    """Option strings of each target's parser, built in one subprocess for those not seen yet.
    Without TRITON_INTERPRET, which the compile report refuses, and with this checkout first."""
    missing = sorted(t for t in targets if f"{t[0]} {t[1]}" not in _PARSERS)
    if missing:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
        result = subprocess.run(
            [sys.executable, "-c", CAPTURE, json.dumps(missing)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        _PARSERS.update(json.loads(result.stdout.strip().split("\n")[-1]))
    return _PARSERS


def command_problems(page_text: str, where: str, root: Path = REPO) -> list[str]:
    """'where:line: command: why' for each command of the page's bash blocks that names nothing
    that exists, or passes a flag its parser does not have."""
    scripts, problems, checks = project_scripts(root), [], []
    for line, argv in bash_commands(page_text):
        target, rest = command_target(argv, scripts, root)
        if isinstance(target, str):
            problems.append(f"{where}:{line}: {shlex.join(argv)}: {target}")
        elif target is not None:
            checks.append((line, argv, target, rest))
    known = parsers({target for _, _, target, _ in checks})
    for line, argv, (kind, name), rest in checks:
        parser = known[f"{kind} {name}"]
        if "error" in parser:
            problems.append(f"{where}:{line}: {name}: no parser: {parser['error']}")
            continue
        allowed = set(parser["options"])
        for token in rest:
            if token == "--":
                break
            if token in parser["subcommands"]:
                allowed |= set(parser["subcommands"][token])
            flag = token.split("=", 1)[0]
            if flag.startswith("-") and not re.match(r"^-\d", flag) and flag not in allowed:
                problems.append(f"{where}:{line}: {shlex.join(argv)}: {name} has no option {flag}")
    return sorted(problems, key=lambda problem: int(problem[len(where) + 1 :].split(":")[0]))


# --------------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", pages(), ids=lambda page: str(page.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    problems = broken_links(page)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", pages(), ids=lambda page: str(page.relative_to(REPO)))
def test_every_command_names_an_entry_point_and_its_flags(page):
    where = str(page.relative_to(REPO))
    problems = command_problems(page.read_text(), where)
    assert not problems, "\n".join(problems)


def test_the_readme_has_the_fresh_machine_commands_and_stays_short():
    """CI and graders run these two lines as they are; the rest of the manual lives in docs/."""
    readme = (REPO / "README.md").read_text()
    commands = [" ".join(argv) for _, argv in bash_commands(readme)]
    assert "fastlm-train" in commands and "pytest tests/ -n auto" in commands
    for extra in ("-e .", '-e ".[dev]"'):
        install = "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0"
        assert f"```bash\n{install} && pip install {extra} && " in readme
    assert 150 <= readme.count("\n") <= 250


def test_github_slugs():
    assert github_slug("The learning-rate schedule and --resume") == (
        "the-learning-rate-schedule-and---resume"
    )
    assert github_slug("The GPU check: tools/gpu_check/gpu_check.sh") == (
        "the-gpu-check-toolsgpu_checkgpu_checksh"
    )
    assert github_slug("### `flash_attention`".lstrip("# ")) == "flash_attention"
    assert github_slug("torch.compile") == "torchcompile"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n## [B](x.md)\n") == {"a", "a-1", "b"}


def test_the_link_check_finds_broken_links(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# Title\n\n## A heading, with `code`\n")
    page = tmp_path / "docs" / "a.md"
    page.write_text(
        "# Page\n[fine](b.md) [fine](b.md#a-heading-with-code) [fine](#page) [web](https://x.y)\n"
        "[gone](missing.md) [bad anchor](b.md#nowhere)\n"
        "[self](#nope) [out](../../outside.md) [case](B.md)\n"
        "`[in code](missing.md)` and [a link\nacross lines](gone/)\n\n[ref]: nothing.md\n"
        "```bash\necho [in a block](missing.md)\n```\n"
    )
    found = broken_links(page, root=tmp_path)
    assert [problem.split(": ")[0:2] for problem in found] == [
        ["docs/a.md:3", "missing.md"],
        ["docs/a.md:3", "b.md#nowhere"],
        ["docs/a.md:4", "#nope"],
        ["docs/a.md:4", "../../outside.md"],
        ["docs/a.md:4", "B.md"],
        ["docs/a.md:5", "gone/"],
        ["docs/a.md:8", "nothing.md"],
    ], found


def test_the_command_check_finds_unknown_commands_and_flags():
    page = """```bash
fastlm-train --steps 3 --out=x && fastlm-generate --checkpoint x --prompt "a(" --top-k 4  # ok
FASTLM_BACKEND=torch torchrun --nproc_per_node=2 -m fastlm.cli.train --fsdp \\
    --stepz 3
fastlm-trian --steps 3
python benchmarks/nope.py
python -m fastlm.cli.nope
python benchmarks/_common.py env --out x --need-cuda | tail -1
python benchmarks/_common.py fingerprint --out x
pytest tests/ -n auto -q
nice -n 10 python -X dev benchmarks/kernels.py --quick --headline
```
"""
    found = command_problems(page, "page.md")
    expected = [
        ("page.md:3: ", "fastlm.cli.train has no option --stepz"),
        (
            "page.md:5: ",
            "fastlm-trian: not an entry point of pyproject.toml, a script here, nor a "
            "standard tool",
        ),
        ("page.md:6: ", "benchmarks/nope.py: no such script in the repository"),
        ("page.md:7: ", "python -m fastlm.cli.nope: no such module in the repository"),
        ("page.md:9: ", "benchmarks/_common.py has no option --out"),
    ]
    assert len(found) == len(expected), found
    for problem, (start, end) in zip(found, expected):
        assert problem.startswith(start) and problem.endswith(end), (problem, start, end)
