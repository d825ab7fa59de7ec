"""What an annotator sees, in a real browser: the whole page in view with its boxes on it.

Headless Chromium (Debian's ``chromium`` and ``chromium-driver``) drives the real Label Studio at
the window sizes annotators use. Skipped with the reason where Chromium or selenium is missing.
``DOCMARKUP_SCREENSHOTS=<dir>`` keeps the screenshots (the README's comes from here).
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

import pytest

from components.curation.labelstudio import (
    LABEL_CONFIGS,
    PagePrediction,
    connect,
    ensure_project,
    queue_pages,
)
from components.data.page_store import PageDataset
from components.data.synthetic import SyntheticConfig, generate_dataset
from components.services.labelstudio import TEST_SERVICE_NAME, load_or_create_credentials

pytestmark = pytest.mark.services

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
WINDOWS = [(1366, 768), (1400, 1000), (1920, 1080)]

# Where the page image, the box layer drawn over it, the label palette and the bottom toolbar are.
MEASURE = """
const rect = e => { const r = e.getBoundingClientRect(); return {x: r.x, y: r.y, w: r.width, h: r.height}; };
const page = [...document.querySelectorAll('img')].find(i => i.naturalWidth > 100 && i.getBoundingClientRect().width > 100);
const layers = [...document.querySelectorAll('canvas')].map(rect);
const palette = [...document.querySelectorAll('[class*="lsf-label"]')].find(e => e.textContent.trim().startsWith('figure'));
const toolbar = document.querySelector('[class*="lsf-bottombar"]');
return {page: page && rect(page), layers, palette: palette && rect(palette), toolbar: toolbar && rect(toolbar)};
"""


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("Chromium is not installed (Debian packages chromium and chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--hide-scrollbars"):
        options.add_argument(argument)
    options.binary_location = CHROMIUM
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _log_in(driver, url: str) -> None:
    from selenium.webdriver.common.by import By

    credentials = load_or_create_credentials(TEST_SERVICE_NAME)
    driver.get(f"{url}/user/login")
    if "login" in driver.current_url:
        driver.find_element(By.NAME, "email").send_keys(credentials.email)
        driver.find_element(By.NAME, "password").send_keys(credentials.password)
        driver.find_element(By.CSS_SELECTOR, "button[type=submit], input[type=submit]").click()
        time.sleep(2)


def _measure(driver, deadline_s: float = 30.0) -> dict:
    """The labelling view's geometry once the page image and its box layer have settled."""
    end, last = time.monotonic() + deadline_s, None
    while time.monotonic() < end:
        found = driver.execute_script(MEASURE)
        if found["page"] and found["layers"] and found == last:
            return found
        last = found
        time.sleep(1.0)
    raise AssertionError(f"the labelling view did not settle: {last}")


@pytest.mark.parametrize("view", ["blocks", "page"])
def test_the_whole_page_and_its_boxes_are_in_view(label_studio, browser, tmp_path, view):
    """Fails if Label Studio draws the page larger than its box layer (the page is then cut on every
    side and the boxes sit off their text), or if the page or the label palette ends under the
    bottom toolbar, at 1366x768, 1400x1000 and 1920x1080."""
    client = connect(label_studio.url, label_studio.api_key)
    project_id = ensure_project(client, f"browser-{uuid.uuid4().hex[:8]}", LABEL_CONFIGS[view])
    try:
        dataset = PageDataset(tmp_path / "pages")
        generate_dataset(dataset.root, 1, seed=5, cfg=SyntheticConfig.preset("tiny"))  # 320x416: smaller than the panel
        page = next(iter(dataset.pages()))
        queued = queue_pages(client, project_id, dataset, [PagePrediction(page.page_id, page.markup, 0.5, tuple(page.elements))],
                             "v1", view=view)
        _log_in(browser, label_studio.url)
        shots = os.environ.get("DOCMARKUP_SCREENSHOTS")
        for width, height in WINDOWS:
            browser.set_window_size(width, height)
            browser.get(f"{label_studio.url}/projects/{project_id}/data?task={queued.task_ids[page.page_id]}")
            found = _measure(browser)
            image, toolbar = found["page"], found["toolbar"]
            if shots:
                Path(shots).mkdir(parents=True, exist_ok=True)
                browser.save_screenshot(str(Path(shots) / f"label_studio_{view}_{width}x{height}.png"))
            where = f"{view} view at {width}x{height}: {found}"
            # The box layer is exactly as large as the page image and at the same place.
            layer = max(found["layers"], key=lambda r: r["w"] * r["h"])
            assert abs(image["x"] - layer["x"]) <= 2 and abs(image["y"] - layer["y"]) <= 2, where
            assert abs(image["w"] - layer["w"]) <= 2 and abs(image["h"] - layer["h"]) <= 2, where
            assert image["w"] / image["h"] == pytest.approx(page.width / page.height, rel=0.02), where
            # The whole page (and the palette) above the bottom toolbar, nothing left of the panel.
            assert image["x"] >= 0 and image["y"] >= 0 and image["y"] + image["h"] <= toolbar["y"] + 1, where
            if view == "blocks":
                assert found["palette"]["y"] + found["palette"]["h"] <= toolbar["y"], where
    finally:
        client.projects.delete(id=project_id)
