"""Open an HTML page in headless Chromium: what loaded, what rendered, and a screenshot.

``make test`` installs Chromium from the OS packages when it is missing (see the Makefile's
``browser`` target); tests that need it skip with ``NO_BROWSER`` where none could be installed.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
NO_BROWSER = ("no Chromium on this machine, and `make test` could not install it (it runs "
              "`apt-get install -y chromium` as root); install a Chromium to run this test")

# Appended to a copy of the page: after the load event, write what the browser made of the page
# into the DOM, where --dump-dom shows it.
PROBE = """<script>
window.addEventListener("load", () => {
  const images = [...document.images].map(
    i => ({alt: i.alt, width: i.naturalWidth, height: i.naturalHeight}));
  const sections = [...document.querySelectorAll("section")].map(s => ({
    id: s.id, heading: (s.querySelector("h2") || {}).textContent || "",
    height: s.getBoundingClientRect().height, text: s.innerText.length}));
  const out = document.createElement("pre");
  out.id = "render-probe";
  out.textContent = JSON.stringify({images, sections, title: document.title});
  document.body.appendChild(out);
});
</script>"""


def find_browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def render(page: Path, screenshot: Path, browser: str, width: int = 1100, height: int = 6000
           ) -> dict[str, Any]:
    """Load ``page``; return its images (natural sizes) and sections (heading, rendered height), and
    save a full-length screenshot of the page as it is (without the probe) to ``screenshot``."""
    page = page.resolve()
    probed = page.with_name(f"{page.stem}.probe.html")
    probed.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    profile = page.parent / ".chromium-profile"
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             f"--user-data-dir={profile}", "--virtual-time-budget=10000"]
    try:
        dom = _run([*flags, "--dump-dom", probed.as_uri()]).stdout
        _run([*flags, "--run-all-compositor-stages-before-draw", f"--window-size={width},{height}",
              f"--screenshot={screenshot}", page.as_uri()])
    finally:
        probed.unlink()
        shutil.rmtree(profile, ignore_errors=True)
    found = re.search(r'<pre id="render-probe">(.*?)</pre>', dom, re.S)
    assert found, f"the page did not finish loading; the browser returned:\n{dom[-2000:]}"
    return json.loads(html.unescape(found.group(1)))


def _run(command: list[str]) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{command[0]} failed ({result.returncode}):\n{result.stderr[-3000:]}"
    return result
