"""Version strings of the optional packages the kernels wrap, as comparable tuples."""


def version_tuple(text: str, parts: int) -> tuple[int, ...]:
    """The first ``parts`` numbers of ``text``, ignoring a local ``+...`` suffix and any
    non-digit (``"2.6.3.post1+cu12"``, 2 parts: ``(2, 6)``); a number with no digit is 0."""
    numbers = []
    for part in text.split("+")[0].split(".")[:parts]:
        numbers.append(int("".join(c for c in part if c.isdigit()) or 0))
    return tuple(numbers)
