"""``sandlot images``: build and inspect the images backends boot (the microVM guest image)."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from sandlot.cli.app import _fail, _print_json, app, err, out
from sandlot.cli.options import JsonOpt
from sandlot.errors import InvalidRequest, SandboxError

__all__ = ["images_app"]

images_app = typer.Typer(
    help="Guest images: build the microVM image, show what is cached.", no_args_is_help=True
)
app.add_typer(images_app, name="images")

KINDS = ("microvm",)


@images_app.command("build")
def build(
    kind: Annotated[str, typer.Argument(help="Which image: microvm.")],
    force: Annotated[
        bool, typer.Option("--force", help="Rebuild even when a cached image matches.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Build an image from Debian packages (cached by a hash of its inputs)."""
    if kind not in KINDS:
        _fail(InvalidRequest(f"unknown image kind {kind!r}; known: {', '.join(KINDS)}"), as_json)
    import anyio
    import anyio.to_thread

    from sandlot.backends.microvm import build_image

    started = time.monotonic()

    def progress(line: str) -> None:
        if not as_json:
            err.print(f"[dim]{time.monotonic() - started:6.1f}s[/dim] {line}")

    try:
        image = anyio.run(
            lambda: anyio.to_thread.run_sync(lambda: build_image(progress=progress, force=force))
        )
    except SandboxError as e:
        _fail(e, as_json)
    if as_json:
        _print_json(
            {
                "kind": kind,
                "directory": str(image.directory),
                "key": image.key,
                "seconds": round(time.monotonic() - started, 1),
            }
        )
    else:
        out.print(f"{kind} image ready: {image.directory}")


@images_app.command("list")
def list_images(as_json: JsonOpt = False) -> None:
    """Show the cached images."""
    from sandlot.backends.microvm.image import find_cached_image

    image = find_cached_image()
    rows = (
        []
        if image is None
        else [{"kind": "microvm", "directory": str(image.directory), "key": image.key}]
    )
    if as_json:
        _print_json(rows)
    elif not rows:
        err.print("no images built yet (sandlot images build microvm)")
    for r in rows:
        out.print(f"{r['kind']}\t{r['key']}\t{r['directory']}")
