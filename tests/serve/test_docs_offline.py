"""/docs and /redoc work with no network: their assets come from this server (the
fastapi-offline package's static folder), and headless Chromium, with every host but
loopback unresolvable, renders the endpoints from /openapi.json."""

from __future__ import annotations

import re
import shutil
import time

import httpx
import pytest

from tests.serve.conftest import live_server

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@pytest.fixture(scope="module")
def server(wan_t2v_dir):
    with live_server(wan_t2v_dir) as s:
        yield s


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_pages_load_every_asset_from_this_server(server, page):
    r = httpx.get(f"{server.url}{page}", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assets = re.findall(r'(?:src|href)="([^"]+)"', r.text)
    assert assets and all(a.startswith("/docs-assets/") for a in assets), assets  # no CDN
    assert "fonts.googleapis" not in r.text
    for asset in assets:
        got = httpx.get(f"{server.url}{asset}", timeout=30)
        assert got.status_code == 200 and len(got.content) > 1000, asset


@pytest.mark.slow
@pytest.mark.skipif(shutil.which(CHROMIUM) is None, reason=f"{CHROMIUM} is missing: apt-get install -y chromium "
                    "chromium-driver (.ci/run installs them)")
@pytest.mark.parametrize("page, rendered", [("/docs", ".opblock-summary-path"), ("/redoc", "[data-section-id]")])
def test_docs_render_the_endpoints_in_headless_chromium_offline(server, page, rendered):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    # the network is off for this browser: every name but loopback fails to resolve, so a CDN
    # asset could not load even on a machine with internet
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        driver.get(f"{server.url}{page}")
        deadline, text = time.monotonic() + 60, ""
        while time.monotonic() < deadline:
            text = " ".join(e.text for e in driver.find_elements(By.CSS_SELECTOR, rendered))
            if "/v1/videos" in text or "videos" in text.lower():
                break
            time.sleep(0.2)
        body = driver.find_element(By.TAG_NAME, "body").text
        assert "/v1/videos" in body and "/v1/images/generations" in body, body[:2000]
    finally:
        driver.quit()
