"""A griffe extension for the API reference: Sphinx markup that Markdown does not know.

The docstrings use Sphinx roles (``:class:`~ringdilated.core.KernelSpec```, ``:meth:`explain```),
which mkdocstrings' Sphinx docstring parser leaves as raw text. This extension rewrites each role,
before the docstring is rendered, into an optional autorefs cross-reference: a link where the
target is documented on the site, plain code where it is not (never a broken link, never a
warning). ``~`` shows only the last component, as in Sphinx. Relative targets (``explain``) are
looked up in the object's own scope, then in its parents'. A literal-block marker ``text::``
becomes ``text:`` (the indented block after it is already code in Markdown), as Sphinx shows it.

Configured in mkdocs.yml (``plugins: mkdocstrings: handlers: python: options: extensions``).
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

ROLE = re.compile(
    r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const|type):`(?P<tilde>~?)(?P<target>[^`<>]+)`"
)


def _identifier(obj: griffe.Object, target: str) -> str:
    """The full path of ``target`` as seen from ``obj`` (Sphinx's lookup), else ``target``."""
    head = target.split(".", 1)[0]
    scope: griffe.Object | None = obj
    while scope is not None:
        member = scope.members.get(head)
        if member is not None:
            try:
                return f"{member.canonical_path}{target[len(head) :]}"
            except griffe.AliasResolutionError:
                return f"{scope.path}.{target}"
        scope = scope.parent
    return target


#: Sphinx's literal-block markers, as Sphinx shows them: ``text::`` as ``text:``, ``text ::`` as
#: ``text``, a line of its own ``::`` as nothing.
LITERAL_MARKERS = (
    (re.compile(r"(?m)^[ \t]*::[ \t]*$"), ""),
    (re.compile(r"(?m)[ \t]+::[ \t]*$"), ""),
    (re.compile(r"(?m)::[ \t]*$"), ":"),
)


def _markdown(obj: griffe.Object, match: re.Match[str]) -> str:
    target = match["target"].strip()
    shown = target.rsplit(".", 1)[-1] if match["tilde"] else target
    identifier = html.escape(_identifier(obj, target), quote=True)
    code = f"<code>{html.escape(shown)}</code>"
    return f'<autoref identifier="{identifier}" optional>{code}</autoref>'


class SphinxRoles(griffe.Extension):
    """Rewrite Sphinx roles in every docstring into optional autorefs cross-references."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.is_alias or obj.docstring is None:
            return
        value = ROLE.sub(lambda m: _markdown(obj, m), obj.docstring.value)
        for marker, replacement in LITERAL_MARKERS:
            value = marker.sub(replacement, value)
        obj.docstring.value = value
