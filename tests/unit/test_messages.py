"""Messages that mislead (issue 22): a placeholder printed literally because its string lacks the
``f`` of the f-string it continues."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import lmforge

PLACEHOLDER = re.compile(r"\{[A-Za-z_][\w.]*(\[[^\]\s]*\])?(![rsa])?(:[^{}\s]*)?\}")


def placeholders_without_f(source: str) -> list[tuple[int, str]]:
    """(line, literal) of each plain string that continues an f-string (implicit concatenation) and
    holds a ``{name}`` placeholder: Python prints it as written."""
    found, group = [], []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in (tokenize.NL, tokenize.COMMENT):
            continue
        if token.type == tokenize.STRING:
            group.append(token)
            continue
        prefixes = [re.match(r"[A-Za-z]*", t.string).group(0).lower() for t in group]
        if any("f" in p for p in prefixes):
            found += [
                (t.start[0], t.string) for t, p in zip(group, prefixes) if "f" not in p and PLACEHOLDER.search(t.string)
            ]
        group = []
    return found


def test_the_scan_finds_the_resume_message_of_issue_22():
    """The FSDP2 resume message printed a literal ``{path}``: its second line lacked the ``f``."""
    old = (
        'raise ConfigError(f"checkpoint {path} was written without FSDP2: resume it with "\n'
        '                  "parallel.strategy=ddp, or start a new run (model.name={path}/model)")\n'
    )
    assert [line for line, _ in placeholders_without_f(old)] == [2]
    assert placeholders_without_f(old.replace('  "parallel', '  f"parallel')) == []
    assert placeholders_without_f('x = "{a}" "{b}"\ny = "{name}".format(name=1)\n') == []  # no f-string: a template


def test_no_placeholder_is_printed_literally():
    root = Path(lmforge.__file__).parent
    found = [
        f"{path.relative_to(root)}:{line}: {text}"
        for path in sorted(root.rglob("*.py"))
        for line, text in placeholders_without_f(path.read_text())
    ]
    assert found == []
