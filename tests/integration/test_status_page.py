"""The status page in a real browser: headless Chromium, driven by Playwright, over mTLS.

A federation of two regions trains a tiny job, paused after its first round. The browser
holds the operator's certificate as the PKCS#12 file the demo writes for a browser, opens
``/ui``, and must see both regions, and, once the job resumes, a validation-loss curve
that grows by itself (the page's script refetches it) as rounds complete, each region's
training-loss curve, an intact audit chain, and no console error (a
Content-Security-Policy violation would be one). Without a certificate the TLS handshake
is refused; with a region's certificate the page is a 403; an observer's is served. The
screenshot is kept in the test's temporary directory.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from geofed.api_paths import ApiPaths
from geofed_cli.demo.browser import write_browser_credential
from tests.support.federation import FederationRun, running_federation

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REGIONS = ("eu-west", "us-east")
ROUNDS = 5
CHROMIUM_NAMES = ("chromium", "chromium-browser")
HOW_TO_INSTALL = (
    "install Debian's chromium (scripts/install-system-deps.sh does, as root: "
    "apt-get install -y chromium) and the playwright wheel (pip install -e '.[dev]'); "
    "do not run `playwright install`, the system Chromium is used"
)


def _chromium() -> str:
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    pytest.fail(f"no Chromium on PATH: {HOW_TO_INSTALL}")


@asynccontextmanager
async def _browser() -> AsyncIterator[Any]:
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        pytest.fail(f"the playwright package is missing: {HOW_TO_INSTALL}")
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=_chromium(), headless=True)
        try:
            yield browser
        finally:
            await browser.close()


async def _val_points(page: Any) -> int:
    count: int = await page.locator("svg.val-loss circle.pt").count()
    return count


async def _wait_points(page: Any, more_than: int, timeout_s: float) -> int:
    """Wait (the page refreshing itself) until the validation curve has more points."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        points = await _val_points(page)
        if points > more_than:
            return points
        await page.wait_for_timeout(500)
    raise AssertionError(f"the validation curve stayed at {more_than} points for {timeout_s} s")


async def test_the_status_page_in_chromium(tmp_path: Path) -> None:
    async with (
        running_federation(tmp_path, regions=REGIONS, rounds=ROUNDS, inner_steps=3) as fed,
        _browser() as browser,
    ):
        status, body = await fed.submit()
        assert status == 201, body
        await _check_access(fed, browser)
        await fed.wait_round(1)
        await _act(fed, "pause")  # so that rounds are left for the page to see complete
        await fed.wait_for(lambda s: s["state"] == "paused", timeout_s=30, what="the pause")
        operator = write_browser_credential(fed.federation.operator.directory)
        context = await browser.new_context(
            ignore_https_errors=True,  # the demo CA is not the browser's to trust
            viewport={"width": 1280, "height": 900},
            client_certificates=[
                {
                    "origin": fed.base,
                    "pfxPath": str(operator.p12),
                    "passphrase": operator.passphrase,
                }
            ],
        )
        page = await context.new_page()
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        response = await page.goto(f"{fed.base}{ApiPaths.UI}?refresh=1")
        assert response is not None
        assert response.status == 200, await response.text()
        assert "default-src 'none'" in (await response.header_value("content-security-policy"))

        assert await page.title() == "geofed · demo"
        names = await page.locator("#regions .region-name").all_inner_texts()
        assert set(REGIONS) <= set(names), names  # and the federation's other regions
        for region in REGIONS:
            name = page.locator(".region-name", has_text=region)
            row = page.locator("#regions tbody tr", has=name)
            assert await row.locator(".state").inner_text() != "unknown", region
        assert await page.locator(f"#jobs-table a[href='#job-{fed.job}']").count() == 1
        before = await _val_points(page)
        assert before >= 1
        assert before < ROUNDS  # paused with rounds to go: the curve must still grow
        await _act(fed, "resume")
        # The page refetches itself: the curve grows while the browser just watches.
        after = await _wait_points(page, before, timeout_s=180)
        assert after > before
        for region in REGIONS:
            series = page.locator(f"svg.train-loss circle.pt[data-series='{region}']")
            assert await series.count() >= 1, region
        assert await page.locator("#chain .chain-ok").count() == 1
        assert await page.locator("#audit-tail tbody tr").count() >= 5
        assert await page.locator("svg.timeline rect.bar").count() >= 1
        # The agents reported how their rounds split: training and communication bars.
        assert await page.locator("svg.timeline rect.bar.train").count() >= 1
        assert await page.locator("svg.timeline rect.bar.comm").count() >= 1

        final = await fed.wait_completed()
        await _wait_points(page, len(final["val_loss_history"]) - 1, timeout_s=30)
        shot = tmp_path / "status-page.png"
        await page.screenshot(path=str(shot), full_page=True)
        print(f"status page screenshot: {shot} (validation curve {before} -> {after} points)")
        assert shot.stat().st_size > 10_000
        assert errors == [], errors
        await context.close()


async def _act(fed: FederationRun, action: str) -> None:
    async with fed.http.post(f"{fed.base}{ApiPaths.job_action(fed.job, action)}") as response:
        assert response.status == 200, await response.text()


async def _check_access(fed: FederationRun, browser: Any) -> None:
    """No certificate: the handshake fails. A region's certificate: 403. An observer's: 200."""
    bare = await browser.new_context(ignore_https_errors=True)
    page = await bare.new_page()
    with pytest.raises(Exception, match=r"net::ERR_"):
        await page.goto(f"{fed.base}{ApiPaths.UI}")
    await bare.close()
    region = fed.federation.regions[REGIONS[0]]
    as_region = await browser.new_context(
        ignore_https_errors=True,
        client_certificates=[
            {"origin": fed.base, "certPath": str(region.cert), "keyPath": str(region.key)}
        ],
    )
    page = await as_region.new_page()
    response = await page.goto(f"{fed.base}{ApiPaths.UI}")
    assert response is not None
    assert response.status == 403
    assert "forbidden" in await response.text()
    await as_region.close()
    observer = await browser.new_context(
        ignore_https_errors=True,
        client_certificates=[
            {
                "origin": fed.base,
                "certPath": str(fed.observer.cert),
                "keyPath": str(fed.observer.key),
            }
        ],
    )
    page = await observer.new_page()
    response = await page.goto(f"{fed.base}{ApiPaths.UI}?part=main")
    assert response is not None
    assert response.status == 200
    live = await response.text()  # the part the page's script refetches
    assert 'id="federation"' in live
    assert "<html" not in live
    await observer.close()
