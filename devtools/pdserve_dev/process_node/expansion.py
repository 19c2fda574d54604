"""Kubernetes' ``$(VAR)`` expansion for env values, command and args.

The rules, as the kubelet applies them (they are not shell rules):

* ``$(NAME)`` is replaced by the value of NAME when NAME is defined; an undefined reference stays as written.
* ``$$`` is an escaped ``$``: ``$$(NAME)`` yields the literal text ``$(NAME)``.
* A ``$`` followed by anything else, a trailing ``$`` and an unclosed ``$(`` are copied unchanged.
* Replaced values are not expanded again.
"""

from __future__ import annotations

from collections.abc import Mapping


def expand(text: str, variables: Mapping[str, str]) -> str:
    """Return ``text`` with every ``$(NAME)`` that ``variables`` defines replaced by its value."""
    out: list[str] = []
    i = 0
    n = len(text)
    while i < n:
        char = text[i]
        if char != "$" or i + 1 == n:
            out.append(char)
            i += 1
            continue
        following = text[i + 1]
        if following == "$":
            # Escaped operator: emit one "$" and skip both.
            out.append("$")
            i += 2
        elif following == "(":
            close = text.find(")", i + 2)
            if close == -1:
                # Unclosed reference: keep "$(" and go on scanning after it.
                out.append("$(")
                i += 2
                continue
            name = text[i + 2 : close]
            out.append(variables.get(name, f"$({name})"))
            i = close + 1
        else:
            out.append("$" + following)
            i += 2
    return "".join(out)
