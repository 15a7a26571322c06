"""The dashboard's routes: the page (which holds no data), its data for a key (what that key
may see), and evaluation reports as downloads (``dashboard`` builds the page and the data)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from .dashboard import WINDOWS, dashboard_page, list_reports, summarise
from .errors import ApiError
from .requests import authenticate
from .served import Served

__all__ = ["add_dashboard_routes"]


def add_dashboard_routes(app: FastAPI, served: Served) -> None:
    """``/dashboard``, ``/dashboard/data`` and ``/dashboard/reports/{name}``."""
    backend, keys, options = served.backend, served.keys, served.options
    audit = options.audit

    @app.get("/dashboard")
    async def dashboard() -> Response:
        # The page holds no data: its script asks /dashboard/data with the key.
        return HTMLResponse(
            dashboard_page(),
            headers={
                "Cache-Control": "no-store",
                "Content-Security-Policy": (
                    "default-src 'none'; script-src 'unsafe-inline'; "
                    "style-src 'unsafe-inline'; img-src data:; connect-src 'self'; "
                    "frame-ancestors 'none'"
                ),
            },
        )

    @app.get("/dashboard/data")
    async def dashboard_data(request: Request, window: str = "5m") -> Response:
        key = authenticate(keys, request)
        if window not in WINDOWS:
            message = f"window must be one of {list(WINDOWS)}, got {window!r}"
            raise ApiError(422, message, "invalid_request_error", param="window")
        everything = "*" in key.policies
        data = summarise(
            served.calls,
            window,
            backend.policies,
            may_use=key.may_use,
            everything=everything,
            describe={p.name: backend.describe(p) for p in backend.policies},
            key=key.name,
        )
        data["model"] = backend.model_name
        data["engine"] = backend.engine
        if everything:
            data["activity"] = await backend.report_activity()
            data["reports"] = list_reports(options.reports_dir)
            if audit is not None:
                data["audit"] = {
                    "healthy": audit.healthy,
                    "buffered": audit.buffered,
                    "written": audit.written,
                    "dropped": audit.dropped,
                }
        return JSONResponse(data, headers={"Cache-Control": "no-store"})

    @app.get("/dashboard/reports/{name}")
    async def dashboard_report(request: Request, name: str) -> Response:
        key = authenticate(keys, request)
        if "*" not in key.policies:
            message = f"API key {key.name!r} may not read evaluation reports"
            raise ApiError(403, message, "permission_error", code="reports_denied")
        if name not in list_reports(options.reports_dir):  # never a path of the caller's
            raise ApiError(404, f"no report {name!r}", "not_found_error")
        assert options.reports_dir is not None
        # A download, never a page of this origin: the report is a file somebody wrote,
        # and this origin's pages hold API keys.
        return Response(
            (options.reports_dir / name).read_bytes(),
            media_type="application/octet-stream",
            headers={
                "Cache-Control": "no-store",
                "Content-Disposition": f'attachment; filename="{name}"',
                "Content-Security-Policy": "sandbox; default-src 'none'",
                "X-Content-Type-Options": "nosniff",
            },
        )
