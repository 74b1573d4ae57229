"""A real browser for the tests that check HTML pages: Debian's headless Chromium, driven through
its chromedriver by Selenium (scripts/chromium.sh finds or installs both). Without them the test
skips, unless FERRY_REQUIRE_BROWSER=1 (CI sets it)."""
import contextlib
import os
import shutil

import pytest


def _paths():
    chromium = os.environ.get("FERRY_CHROMIUM") or shutil.which("chromium")
    driver = os.environ.get("FERRY_CHROMEDRIVER") or shutil.which("chromedriver")
    return chromium, driver


@contextlib.contextmanager
def chromium(width=1100, height=900, phone=False):
    """phone: Chromium's mobile emulation at a phone's size (390 x 844 CSS pixels, the viewport meta
    tag honoured), as a phone lays the page out."""
    chromium, driver = _paths()
    if not (chromium and driver):
        if os.environ.get("FERRY_REQUIRE_BROWSER") == "1":
            pytest.fail("FERRY_REQUIRE_BROWSER=1 but chromium and chromedriver are not installed (scripts/chromium.sh)")
        pytest.skip("no chromium and chromedriver (Debian's chromium, chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", f"--window-size={width},{height}"):
        options.add_argument(arg)
    if phone:
        options.add_experimental_option("mobileEmulation", {"deviceMetrics": {"width": 390, "height": 844,
                                                                              "pixelRatio": 2}})
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # An explicit driver path: Selenium then never tries to download one.
    d = webdriver.Chrome(service=Service(executable_path=driver), options=options)
    try:
        yield d
    finally:
        d.quit()


def full_page_screenshot(driver, path):
    """The whole page, not only the window: the window is resized to the page's height first."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    width = driver.execute_script("return window.innerWidth")
    driver.set_window_size(width, min(int(height) + 120, 8000))
    driver.save_screenshot(str(path))
