"""What the HTML pages of the server and the router share (``head.html``: the doctype, the meta
tags, the colours and common style, the ``$`` and ``esc`` script helpers).

A layer-1 package (the standard library only), so the router, which may import nothing of the
server, reads it too. A page names the place of the shared head with a ``<!-- loraplex:head -->``
line, which :func:`read_page` replaces when the page is served: the browser still gets one
self-contained HTML file (no external resources, no extra route to authorize).
"""

from __future__ import annotations

from importlib import resources

HEAD_MARKER = "<!-- loraplex:head -->\n"


def read_page(package: str, path: str) -> str:
    """The page at ``path`` in ``package`` (package data), the shared head in its place."""
    page = resources.files(package).joinpath(path).read_text(encoding="utf-8")
    if HEAD_MARKER not in page:
        raise ValueError(f"{package}/{path} has no {HEAD_MARKER.strip()} line")
    head = resources.files(__name__).joinpath("head.html").read_text(encoding="utf-8")
    return page.replace(HEAD_MARKER, head, 1)
