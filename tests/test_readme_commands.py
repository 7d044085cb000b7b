"""README.md tells the truth about installing and testing: its install block runs the script
``.ci/run`` runs, its test command is the one ``.ci/run`` runs, and its shapes-world
vocabulary table is the evaluator's vocabulary, every `omniloop` command in it and docs/ parses,
and the install builds without warnings of our own making."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from omniloop.eval.shapes_world import BACKGROUNDS, COLORS, MOTIONS, SHAPES

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text()


def _section_block(title: str) -> list[str]:
    """The commands of the first ```bash block under ``## title`` (comments and blanks dropped)."""
    section = README.split(f"\n## {title}\n", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, f"README's '{title}' section has no bash block"
    return [line.split("#", 1)[0].strip() for line in block.group(1).splitlines() if line.split("#", 1)[0].strip()]


def _ci_commands() -> list[str]:
    return [line.strip() for line in CI.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_readme_install_is_what_ci_installs():
    install = _section_block("Install")
    scripts = [c for c in install if c.startswith("bash scripts/")]
    assert scripts == ["bash scripts/install_dev.sh"], install
    assert "bash scripts/install_dev.sh" in _ci_commands()
    assert not any(c.startswith(("pip install", "python -m pip install")) for c in _ci_commands()), \
        "CI installs packages beside the README's script: put them in scripts/install_dev.sh"
    assert (ROOT / "scripts" / "install_dev.sh").exists()


def test_readme_test_command_is_what_ci_runs():
    (command,) = _section_block("Test")
    ci_pytest = [c for c in _ci_commands() if "-m pytest" in c]
    assert len(ci_pytest) == 1, ci_pytest
    # CI adds only reporting flags (-rs, the JUnit report) and its exit-code handling
    ci = re.sub(r" -rs| --junitxml=\S+| \|\| rc=\$\?", "", ci_pytest[0])
    assert ci == command, (ci, command)


def test_readme_vocabulary_is_the_evaluators():
    rows = dict(re.findall(r"^\| (colors|shapes|motions|backgrounds) \(\d+\) \| ([^|(]+)", README, re.M))

    def words(kind: str) -> list[str]:
        return [w.strip() for w in rows[kind].split(",")]

    assert words("colors") == list(COLORS) and words("shapes") == list(SHAPES)
    assert words("motions") == list(MOTIONS) and words("backgrounds") == list(BACKGROUNDS)
    counts = dict(re.findall(r"^\| (\w+) \((\d+)\)", README, re.M))
    assert counts == {"colors": str(len(COLORS)), "shapes": str(len(SHAPES)), "motions": str(len(MOTIONS)),
                      "backgrounds": str(len(BACKGROUNDS))}


def _fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every ``` block, in order."""
    blocks, body, lang = [], None, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if body is None:
                body, lang = [], line.strip()[3:]
            else:
                blocks.append((lang, "\n".join(body)))
                body = None
        elif body is not None:
            body.append(line)
    return blocks


def _omniloop_commands(text: str) -> list[tuple[str, ...]]:
    """Each ``omniloop ...`` command of the shell blocks, as its argv: continuations joined,
    comments, env assignments and `&&` / `&` / `;` neighbours dropped (quotes respected);
    usage lines (``[--flag]``) skipped."""
    import shlex

    out = []
    for lang, body in _fenced_blocks(text):
        if lang not in ("", "bash", "sh", "console"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            if "omniloop " not in line:  # prose and file trees in untagged blocks need not lex
                continue
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split, lexer.commenters = True, "#"
            command: list[str] = []
            for token in [*lexer, ";"]:
                if token.strip(";&|"):
                    if command or not re.fullmatch(r"[A-Z_]+=\S*", token):  # VAR=value before a command
                        command.append(token)
                elif command:
                    if command[0] == "omniloop" and not any(t.startswith("[--") for t in command):
                        out.append(tuple(command))
                    command = []
    return out


def test_every_omniloop_command_in_the_docs_parses():
    """A flag renamed or removed leaves no stale command in README.md or docs/: each command a
    user would paste parses with this CLI's parser, every flag known to its subcommand."""
    from omniloop.api.cli import build_parser

    found = {}
    for doc in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        for command in _omniloop_commands(doc.read_text()):
            found[command] = doc.name
            try:
                args, extras = build_parser().parse_known_args(command[1:])
            except SystemExit:
                raise AssertionError(f"{doc.name}: {' '.join(command)!r} does not parse") from None
            assert not extras and args.command, (doc.name, command, extras)
    assert ("omniloop", "generate", "a red circle moving right") in found and ("omniloop", "serve") in found
    assert any(c[:3] == ("omniloop", "comfy", "check") for c in found)  # docs/comfyui.md's
    assert len(found) >= 30, len(found)  # the walk reaches the serving guide's commands too


def test_the_top_level_help_starts_with_the_readmes_commands():
    """``omniloop --help``'s "start here" commands are the README's, so the two cannot drift."""
    from omniloop.api.cli import START_HERE

    import shlex

    readme = set(_omniloop_commands(README))
    listed = [tuple(shlex.split(line, comments=True)) for line in START_HERE.splitlines()[1:] if line.startswith("  ")]
    assert len(listed) == 4 and all(command in readme for command in listed), (listed, readme)


def test_the_install_builds_without_setuptools_deprecation_warnings():
    """`pip install -e .` printed setuptools' boxed "`project.license` as a TOML table is
    deprecated" warning twice in the README's install: the license is an SPDX string, which
    needs setuptools >= 77 in the build requirements."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert isinstance(project["project"]["license"], str), project["project"]["license"]
    (setuptools,) = [r for r in project["build-system"]["requires"] if r.startswith("setuptools")]
    assert setuptools == "setuptools>=77", setuptools
