"""What an annotator sees, in a real browser: the whole page in view with its boxes on it.

Headless Chromium (Debian's ``chromium`` and ``chromium-driver``) drives the real Label Studio at
the window sizes annotators use. Skipped with the reason where Chromium or selenium is missing.
``DOCMARKUP_SCREENSHOTS=<dir>`` keeps the screenshots (the README's comes from here).
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
import uuid
from pathlib import Path

import pytest

from components.curation.labelstudio.api import connect
from components.curation.labelstudio.interface import LABEL_CONFIGS
from components.curation.labelstudio.predictions import PagePrediction
from components.curation.labelstudio.project import ensure_project
from components.curation.labelstudio.queue import queue_pages
from components.data.page_store import PageDataset
from components.data.synthetic import SyntheticConfig, generate_dataset
from components.services.labelstudio import TEST_SERVICE_NAME, load_or_create_credentials

pytestmark = pytest.mark.services

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
REAL_PAGES = Path(__file__).parent / "fixtures" / "corpus_pages"  # held-out pages of Debian manuals
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


MIN_TEXT_PX = 9  # a body text line drawn lower than this is not readable


def _scroll_page_panel(driver, to: str) -> None:
    """Scroll the page's column (the element that scrolls around the page image) to its top or bottom."""
    driver.execute_script("""
const page = [...document.querySelectorAll('img')].find(i => i.naturalWidth > 100 && i.getBoundingClientRect().width > 100);
let panel = page && page.parentElement;
while (panel && !(panel.scrollHeight > panel.clientHeight + 1 && getComputedStyle(panel).overflowY === 'auto')) panel = panel.parentElement;
if (panel) panel.scrollTop = arguments[0] === 'bottom' ? panel.scrollHeight : 0;
""", to)


def _queued_page(client, project_id: int, dataset: PageDataset, view: str):
    page = next(iter(dataset.pages()))
    queued = queue_pages(client, project_id, dataset, [PagePrediction(page.page_id, page.markup, 0.5, tuple(page.elements))],
                         "v1", view=view)
    return page, queued.task_ids[page.page_id]


def _body_line_height(page) -> float:
    """The median height of the page's body text lines, in page pixels (real pages record them)."""
    heights = [box[3] - box[1] for element, boxes in zip(page.elements, page.meta.get("element_lines", []), strict=False)
               if element.category == "text" for box in boxes]
    return statistics.median(heights) if heights else 0.0


@pytest.mark.parametrize("kind", ["synthetic", "real"])
@pytest.mark.parametrize("view", ["blocks", "page"])
def test_the_page_is_readable_and_its_boxes_stay_on_its_text(label_studio, browser, tmp_path, view, kind):
    """Fails if Label Studio draws the page at another size or place than its box layer (the boxes
    then sit off their text), if the page is wider than its window, if a real page's body text is
    drawn under 9 px high (the page shrunk to fit the window's height), if the page's top or the
    label palette is hidden under the bottom toolbar, or if its bottom cannot be scrolled into view;
    at 1366x768, 1400x1000 and 1920x1080. ``real``: a page of a Debian manual (1224x1584)."""
    client = connect(label_studio.url, label_studio.api_key)
    project_id = ensure_project(client, f"browser-{uuid.uuid4().hex[:8]}", LABEL_CONFIGS[view])
    try:
        if kind == "real":
            source = PageDataset(REAL_PAGES)
            dataset = PageDataset(tmp_path / "pages")
            first = source.pages()[0]
            first.image = dataset.save_image(first.page_id, source.load_image(first))
            first.meta["preannotation"] = {"model_version": "v1", "markup": first.markup, "confidence": 1.0,
                                           "extra": {"source": "text-layer"}}
            dataset.upsert([first])
        else:
            dataset = PageDataset(tmp_path / "pages")
            generate_dataset(dataset.root, 1, seed=5, cfg=SyntheticConfig.preset("tiny"))  # 320x416: smaller than the panel
        page, task_id = _queued_page(client, project_id, dataset, view)
        line_height = _body_line_height(page)
        assert kind == "synthetic" or line_height > 10
        _log_in(browser, label_studio.url)
        shots = os.environ.get("DOCMARKUP_SCREENSHOTS")
        for width, height in WINDOWS:
            browser.set_window_size(width, height)
            browser.get(f"{label_studio.url}/projects/{project_id}/data?task={task_id}")
            found = _measure(browser)
            image, toolbar = found["page"], found["toolbar"]
            if shots:
                Path(shots).mkdir(parents=True, exist_ok=True)
                browser.save_screenshot(str(Path(shots) / f"label_studio_{view}_{kind}_{width}x{height}.png"))
            where = f"{view} view, {kind} page at {width}x{height}: {found}"
            if view == "blocks":  # the box layer is exactly as large as the page image and at the same place
                layer = max(found["layers"], key=lambda r: r["w"] * r["h"])
                assert abs(image["x"] - layer["x"]) <= 2 and abs(image["y"] - layer["y"]) <= 2, where
                assert abs(image["w"] - layer["w"]) <= 2 and abs(image["h"] - layer["h"]) <= 2, where
            assert image["w"] / image["h"] == pytest.approx(page.width / page.height, rel=0.02), where
            # The whole width in the window, the top of the page (and the palette) above the toolbar.
            assert image["x"] >= 0 and image["x"] + image["w"] <= width and 0 <= image["y"] < toolbar["y"] - 100, where
            if view == "blocks":
                assert found["palette"]["y"] + found["palette"]["h"] <= toolbar["y"], where
            header = browser.execute_script("return document.body.innerText")
            assert kind != "real" or "Prefilled: v1 (confidence 0.50); text from the PDF's text layer" in header, where
            if kind == "real":  # readable: body lines at least MIN_TEXT_PX high on screen
                on_screen = line_height * image["h"] / page.height
                assert on_screen >= MIN_TEXT_PX, f"body text {on_screen:.1f} px high; {where}"
                # The first screen shows the page's first lines of text, not only its top margin.
                first_text = min(e.bbox[1] for e in page.elements if e.category in ("title", "text"))
                first_line_bottom = image["y"] + (first_text + 2 * line_height) * image["h"] / page.height
                assert first_line_bottom <= toolbar["y"], f"first text line at {first_line_bottom:.0f} px; {where}"
            _scroll_page_panel(browser, "bottom")
            bottom = _measure(browser)
            assert bottom["page"]["y"] + bottom["page"]["h"] <= bottom["toolbar"]["y"] + 1, f"bottom out of reach; {bottom}"
            if view == "blocks":
                layer = max(bottom["layers"], key=lambda r: r["w"] * r["h"])
                assert abs(bottom["page"]["y"] - layer["y"]) <= 2, f"boxes left the page when scrolled; {bottom}"
    finally:
        client.projects.delete(id=project_id)
