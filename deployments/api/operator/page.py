"""The page for people at /ui (like llama.cpp's server UI): static files shipped in the
package, no build step. It talks to the same routes any client does."""

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, RedirectResponse

from app.protocol.errors import NotFoundError

UI = Path(__file__).resolve().parents[2] / "ui"  # deployments/ui
FILES = {"app.js": "text/javascript", "style.css": "text/css"}
router = APIRouter()


@router.get("/ui")
async def page() -> FileResponse:
    return FileResponse(UI / "index.html", media_type="text/html")


@router.get("/ui/")
async def page_slash() -> RedirectResponse:
    return RedirectResponse("../ui")


@router.get("/ui/{name}")
async def asset(name: str) -> FileResponse:
    if name not in FILES:  # a fixed list: no path reaches outside the folder
        raise NotFoundError(f"no file {name!r}")
    return FileResponse(UI / name, media_type=FILES[name])
