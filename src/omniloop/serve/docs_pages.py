"""``/docs`` (Swagger UI) and ``/redoc`` served with no network: their JavaScript and CSS come
from the installed ``fastapi-offline`` package's static folder, mounted at ``/docs-assets``,
through FastAPI's own self-hosting recipe (``get_swagger_ui_html`` / ``get_redoc_html`` with
local URLs). FastAPI's defaults load them from a CDN, which is a blank page offline."""

from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS_URL = "/docs-assets"


def install_docs(app: FastAPI) -> None:
    """Add /docs, its OAuth2 redirect and /redoc to ``app`` (created with ``docs_url=None,
    redoc_url=None``), every asset served from this process."""
    assets = files("fastapi_offline") / "static"
    app.mount(ASSETS_URL, StaticFiles(directory=str(assets)), name="docs-assets")
    openapi_url, redirect_url = app.openapi_url or "/openapi.json", app.swagger_ui_oauth2_redirect_url

    def local(request: Request, name: str) -> str:
        return f"{request.scope.get('root_path', '')}{ASSETS_URL}/{name}"

    @app.get("/docs", include_in_schema=False)
    async def swagger(request: Request) -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=f"{request.scope.get('root_path', '')}{openapi_url}",
                                   title=f"{app.title} - Swagger UI", oauth2_redirect_url=redirect_url,
                                   swagger_js_url=local(request, "swagger-ui-bundle.js"),
                                   swagger_css_url=local(request, "swagger-ui.css"),
                                   swagger_favicon_url=local(request, "favicon.png"))

    if redirect_url:
        @app.get(redirect_url, include_in_schema=False)
        async def swagger_redirect() -> HTMLResponse:
            return get_swagger_ui_oauth2_redirect_html()

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        return get_redoc_html(openapi_url=f"{request.scope.get('root_path', '')}{openapi_url}",
                              title=f"{app.title} - ReDoc", redoc_js_url=local(request, "redoc.standalone.js"),
                              redoc_favicon_url=local(request, "favicon.png"), with_google_fonts=False)
