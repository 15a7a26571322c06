"""``/dashboard``: a live server's numbers per policy, checked against the runtime's own stats of
the calls made; keys see only their policies; no content ever; and the page itself, rendered
by a real headless browser, shows those numbers."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_server import KEYS, Live, key_file, live, serving, sync_client

SECRET = "the-words-of-a-confidential-ticket"


def data(live: Live, key: str = "full", window: str = "all") -> dict[str, Any]:
    response = httpx.get(
        f"{live.url}/dashboard/data",
        params={"window": window},
        headers={"Authorization": f"Bearer {KEYS[key]}"},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    return response.json()


def chat(live: Live, policy: str, key: str = "full", **extra: Any) -> Any:
    return sync_client(live.base_url, KEYS[key]).chat.completions.create(
        model=f"tiny:{policy}",
        messages=[{"role": "user", "content": f"{SECRET}: summarise our order A-10234."}],
        max_tokens=16,
        **extra,
    )


def test_the_page_holds_no_data_and_loads_nothing_from_elsewhere(live: Live) -> None:
    response = httpx.get(f"{live.url}/dashboard", timeout=30)
    assert response.status_code == 200
    page = response.text
    assert "<table" in page
    assert "customer-reply" not in page  # policies come from the data, behind a key
    assert not re.search(r"""(src|href)=["']https?://""", page)
    assert "connect-src 'self'" in response.headers["content-security-policy"]


def test_the_data_needs_a_key_and_a_known_window(live: Live) -> None:
    assert httpx.get(f"{live.url}/dashboard/data", timeout=30).status_code == 401
    bad = httpx.get(
        f"{live.url}/dashboard/data",
        params={"window": "1d"},
        headers={"Authorization": f"Bearer {KEYS['full']}"},
        timeout=30,
    )
    assert bad.status_code == 422
    assert bad.json()["error"]["param"] == "window"


def test_counts_divergence_and_sources_follow_the_calls(live: Live) -> None:
    before = data(live)
    lossless = [chat(live, "customer-reply") for _ in range(3)]
    relaxed = [chat(live, "internal-summary", temperature=0.8, seed=i) for i in range(2)]
    stream = chat(live, "customer-reply", stream=True)
    streamed = list(stream)
    assert streamed
    refused = httpx.post(  # over the server's token cap: 422, before any policy is known
        f"{live.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEYS['full']}"},
        json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6},
        timeout=30,
    )
    assert refused.status_code == 422
    after = data(live)

    def delta(policy: str, field: str) -> Any:
        return after["policies"][policy][field] - before["policies"][policy][field]

    assert delta("customer-reply", "calls") == 4  # three calls and one stream
    assert delta("internal-summary", "calls") == 2
    assert after["unresolved"]["calls"] - before["unresolved"]["calls"] == 1
    assert after["unresolved"]["errors"].get("422", 0) >= 1
    assert after["total"]["calls"] - before["total"]["calls"] == 7
    tokens = sum(r.usage.completion_tokens for r in [*lossless, *relaxed])
    assert (
        delta("customer-reply", "output_tokens") + delta("internal-summary", "output_tokens")
        >= tokens
    )
    summary = after["policies"]["internal-summary"]
    assert summary["mode"] == "relaxed"
    assert summary["divergence"]["max_divergence"] == pytest.approx(0.10)
    assert summary["divergence"]["calls"] >= 2
    assert after["policies"]["customer-reply"]["divergence"] is None  # lossless: none, ever
    assert 0 <= summary["divergence"]["mean"] <= summary["divergence"]["p95"] <= 1
    for name in ("customer-reply", "internal-summary"):
        described = after["policies"][name]
        assert described["engine"] == "transformers"
        assert described["drafter"]
        assert described["latency_s"]["p50"] > 0
    assert after["activity"]["running"] == 0


def test_windows_forget_older_calls_and_quantiles_stay_within_a_percent(monkeypatch) -> None:
    """The log as a clock moves: a window holds the calls of its span (to a bucket), ``all``
    every call since the start; quantiles from the bins are within 1% of the exact ones."""
    import random
    import types

    from specagent import shipped_policies
    from specagent.server import dashboard

    clock = [1000.0]
    monkeypatch.setattr(dashboard, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    log, policies, rng = dashboard.CallLog(), shipped_policies(), random.Random(0)

    def call(latency: float, divergence: float | None = None) -> None:
        log.record(
            dashboard.CallRecord(
                policy="internal-summary",
                status=200,
                latency_s=latency,
                ttft_s=latency / 10,
                output_tokens=10,
                divergence=divergence,
            )
        )

    latencies = [rng.lognormvariate(0, 1) for _ in range(1000)]
    for i, latency in enumerate(latencies):
        clock[0] = 1000.0 + i * 0.05  # 50 s of calls
        call(latency, divergence=0.02)
    clock[0] = 1400.0
    for _ in range(10):
        call(0.5)
    clock[0] = 1400.5
    for _ in range(3):
        log.record(dashboard.CallRecord(policy=None, status=401))

    def numbers(window: str) -> dict[str, Any]:
        return dashboard.summarise(log, window, policies, may_use=lambda _: True, everything=True)

    assert numbers("5m")["policies"]["internal-summary"]["calls"] == 10
    assert numbers("1h")["policies"]["internal-summary"]["calls"] == 1010
    whole = numbers("all")
    row = whole["policies"]["internal-summary"]
    assert row["calls"] == 1010
    assert whole["total"]["calls"] == 1013
    assert whole["unresolved"]["errors"] == {"401": 3}
    ordered = sorted([*latencies, *[0.5] * 10])
    for q in (0.5, 0.95):
        exact = ordered[math.ceil(q * len(ordered)) - 1]
        assert row["latency_s"][f"p{round(q * 100)}"] == pytest.approx(exact, rel=0.0101)
    assert row["divergence"]["mean"] == pytest.approx(0.02)
    assert row["divergence"]["p95"] == pytest.approx(0.02)  # one value: exact
    assert row["divergence"]["calls"] == 1000
    assert row["output_tokens"] == 10_100
    clock[0] = 1400.0 + 3700.0  # an hour later: only "all" remembers
    assert numbers("1h")["policies"]["internal-summary"]["calls"] == 0
    assert numbers("all")["policies"]["internal-summary"]["calls"] == 1010


def test_a_key_sees_only_its_policies_and_never_any_content(live: Live) -> None:
    chat(live, "customer-reply", key="customer")
    mine = data(live, key="customer")
    assert set(mine["policies"]) <= {"customer-reply", "default"}
    assert "customer-reply" in mine["policies"]
    assert "total" not in mine
    assert "activity" not in mine
    assert "reports" not in mine
    everything = data(live, key="full", window="5m")
    assert "internal-summary" in everything["policies"]
    body = json.dumps(everything)
    assert SECRET not in body
    assert "A-10234" not in body


def test_reports_are_served_to_a_full_key_only(tmp_path: Path, live: Live, key_file) -> None:
    from specagent.server import KeyStore, ServerOptions, create_app

    (tmp_path / "eval_one.html").write_text("<html><body>report</body></html>")
    (tmp_path / "notes.txt").write_text("not a report")
    keys = KeyStore.load(key_file, env="")
    app = create_app(live.runtime, keys, ServerOptions(reports_dir=tmp_path))
    client = _asgi_client(app)
    assert client.get("/dashboard/reports/eval_one.html").status_code == 401
    full = {"Authorization": f"Bearer {KEYS['full']}"}
    report = client.get("/dashboard/reports/eval_one.html", headers=full)
    assert report.text.endswith("</html>")
    # A file to save, never a page of the dashboard's origin (whose storage holds the key).
    assert report.headers["content-type"] == "application/octet-stream"
    assert report.headers["content-disposition"] == 'attachment; filename="eval_one.html"'
    assert report.headers["content-security-policy"].startswith("sandbox")
    assert client.get("/dashboard/reports/notes.txt", headers=full).status_code == 404
    assert client.get("/dashboard/reports/..%2Fkeys.yaml", headers=full).status_code == 404
    restricted = {"Authorization": f"Bearer {KEYS['customer']}"}
    assert client.get("/dashboard/reports/eval_one.html", headers=restricted).status_code == 403
    listed = client.get("/dashboard/data", headers=full).json()
    assert listed["reports"] == ["eval_one.html"]


def test_the_grafana_dashboard_charts_metrics_the_server_exports(live: Live) -> None:
    chat(live, "customer-reply")
    for seed in range(3):  # the tenant's earlier answers draft the later ones
        chat(live, "internal-summary", temperature=0.8, seed=seed)
    text = httpx.get(
        f"{live.url}/metrics", headers={"Authorization": f"Bearer {KEYS['full']}"}, timeout=30
    ).text
    exported = {
        re.split(r"[{ ]", line, maxsplit=1)[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    board = json.loads((Path(__file__).parents[2] / "docs" / "grafana-dashboard.json").read_text())
    queries = [t["expr"] for panel in board["panels"] for t in panel["targets"]]
    queries += [
        v["query"]["query"]
        for v in board["templating"]["list"]
        if "query" in v and isinstance(v["query"], dict)
    ]
    # A metric is what a selector ({...}) or label_values(metric, label) names.
    charted = {
        name
        for q in queries
        for name in re.findall(r"\b(\w+)\{", q) + re.findall(r"label_values\((\w+),", q)
    }
    assert len(charted) >= 8
    assert charted <= exported, charted - exported
    assert 'specagent_draft_source="history"' in text
    assert "specagent_fallbacks_total{" in text
    for state in ("running", "queued"):  # the queue the dashboard shows, now: nothing waits
        assert re.search(
            rf'^specagent_calls\{{[^}}]*specagent_call_state="{state}"[^}}]*\}} 0', text, re.M
        )


def test_refused_calls_are_counted_in_the_metrics_by_status(live: Live) -> None:
    """What the runtime never sees (a bad key, a body over the token cap) is in /metrics as
    the server's HTTP metric, by route and status; a served call carries its policy."""
    url = f"{live.url}/v1/chat/completions"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}
    assert httpx.post(url, json=body, timeout=30).status_code == 401
    full = {"Authorization": f"Bearer {KEYS['full']}"}
    assert httpx.post(url, json=body, headers=full, timeout=30).status_code == 422
    chat(live, "customer-reply")
    text = httpx.get(f"{live.url}/metrics", headers=full, timeout=30).text
    counts = [
        line
        for line in text.splitlines()
        if line.startswith("http_server_request_duration_seconds_count{")
        and 'http_route="/v1/chat/completions"' in line
    ]
    for status in ("401", "422"):
        assert any(f'http_response_status_code="{status}"' in line for line in counts), status
    served = [line for line in counts if 'http_response_status_code="200"' in line]
    assert any('specagent_policy="customer-reply"' in line for line in served)


def _asgi_client(app: Any) -> Any:
    from fastapi.testclient import TestClient

    return TestClient(app)


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def render(url: str, profile: Path, out: Path | None = None) -> str:
    """The page as a headless Chromium renders it after its script ran (the DOM; with
    ``out``, also a screenshot). ``profile``: an empty directory for the browser's profile."""
    browser = chromium()
    assert browser is not None
    base = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=4000",
        "--window-size=1400,700",
    ]
    if out is not None:
        subprocess.run(
            [*base, f"--screenshot={out}", url], check=True, capture_output=True, timeout=120
        )
    done = subprocess.run(
        [*base, "--dump-dom", url], check=True, capture_output=True, text=True, timeout=120
    )
    return done.stdout


def _shown(dom: str, policy: str, field: str) -> str:
    """The text of a policy's cell in the rendered table."""
    row = re.search(rf'<tr data-policy="{re.escape(policy)}">(.*?)</tr>', dom, flags=re.S)
    assert row, f"no row for {policy} in the rendered page"
    found = re.search(rf'data-field="{field}"[^>]*>(.*?)</td>', row.group(1), flags=re.S)
    assert found, field
    return re.sub(r"<[^>]+>", "", found.group(1)).strip()


@pytest.mark.slow
@pytest.mark.skipif(chromium() is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_a_browser_shows_the_numbers_the_runtime_reported(
    live: Live, key_file: Path, tmp_path: Path
) -> None:
    """A dashboard of its own (a fresh call log) over the live runtime: the calls made here,
    rendered by Chromium, against what the runtime itself reported for them (their spans).
    With SPECAGENT_DASHBOARD_SCREENSHOT set, the screenshot is written there (docs use it)."""
    from specagent.server import KeyStore, ServerOptions, create_app

    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "eval_tiny.html").write_text("<!doctype html><html><body>report</body></html>")
    app = create_app(
        live.runtime, KeyStore.load(key_file, env=""), ServerOptions(reports_dir=reports)
    )
    with serving(app) as url:
        fresh = Live(url, live.runtime, app, live.spans, live.model)
        seen = len(live.spans.get_finished_spans())
        for _ in range(2):
            chat(fresh, "customer-reply")
        for seed in range(3):
            chat(fresh, "internal-summary", temperature=0.8, seed=seed)
        reported: dict[str, list[Any]] = {}
        for span in live.spans.get_finished_spans()[seen:]:
            attributes = dict(span.attributes or {})
            if "specagent.policy" in attributes:
                reported.setdefault(str(attributes["specagent.policy"]), []).append(attributes)
        assert {name: len(calls) for name, calls in reported.items()} == {
            "customer-reply": 2,
            "internal-summary": 3,
        }
        shot = tmp_path / "dashboard.png"
        dom = render(f"{url}/dashboard#key={KEYS['full']}&window=all", tmp_path / "p1", shot)
        limited = render(f"{url}/dashboard#key={KEYS['customer']}&window=all", tmp_path / "p2")
    assert shot.stat().st_size > 10_000
    if target := os.environ.get("SPECAGENT_DASHBOARD_SCREENSHOT"):
        shutil.copyfile(shot, target)
    assert "updated" in dom
    for policy, calls in reported.items():
        assert int(_shown(dom, policy, "calls")) == len(calls)
        fallbacks = sum(bool(a.get("specagent.fell_back_to_lossless")) for a in calls)
        assert int(_shown(dom, policy, "fallbacks")) == fallbacks
    assert _shown(dom, "customer-reply", "divergence") == "–"  # lossless: none, ever
    divergences = sorted(float(a["specagent.divergence"]) for a in reported["internal-summary"])
    shown = re.fullmatch(
        r"(\d\.\d{3}) / (\d\.\d{3}) \(0\.10\)", _shown(dom, "internal-summary", "divergence")
    )
    assert shown, _shown(dom, "internal-summary", "divergence")
    mean, p95 = float(shown.group(1)), float(shown.group(2))
    assert mean == pytest.approx(sum(divergences) / len(divergences), abs=6e-4)
    # p95 (nearest rank of three: the top) from log-spaced bins: within 1%, and the 3 digits
    assert p95 == pytest.approx(divergences[-1], rel=0.011, abs=6e-4)
    total = re.search(r'data-field="total-calls"[^>]*>(\d+)<', dom)
    assert total
    assert int(total.group(1)) == 5
    assert 'data-report="eval_tiny.html"' in dom
    # A key limited to one policy: only that one is rendered, and no report.
    assert 'data-policy="customer-reply"' in limited
    assert 'data-policy="internal-summary"' not in limited
    assert "eval_tiny.html" not in limited
    assert SECRET not in dom + limited
