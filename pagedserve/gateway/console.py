"""The browser console at `/`: a playground and a live view of the cluster, as static files
(`static/`: plain HTML, CSS and JavaScript, no build step, nothing fetched from another
origin) that the gateway serves. The page is only a client: it calls the OpenAI routes and
`GET /v1/cluster` (cluster_view.py) with the key the user gives it.

Every file goes out with a strict Content-Security-Policy: scripts and styles from this
origin only (no inline script), connections to this origin only, no frames, no forms, no
plugins. `--no-console` leaves these routes out (create_app).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from litestar import Response, get
from litestar.exceptions import NotFoundException
from litestar.params import PathParameter

STATIC = Path(__file__).parent / "static"

#: the page's policy: nothing but this origin's own files and API
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
#: the files under /console/ and their types; anything else is a 404
_TYPES = {".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}


def _file(name: str) -> Response:
    path = STATIC / name
    if path.suffix not in _TYPES and name != "index.html" or not path.is_file() or path.parent != STATIC:
        raise NotFoundException(f"no console file {name!r}")
    media_type = "text/html" if name == "index.html" else _TYPES[path.suffix]
    return Response(content=path.read_bytes(), media_type=media_type, headers=HEADERS)


@get("/", summary="The console: a playground and the cluster view", include_in_schema=False)
async def console_page() -> Response:
    return _file("index.html")


@get("/console/{name:str}", summary="The console's scripts and styles", include_in_schema=False)
async def console_file(name: Annotated[str, PathParameter()]) -> Response:
    return _file(name)


#: the console's routes, as create_app mounts them (unless --no-console)
CONSOLE_HANDLERS = [console_page, console_file]
