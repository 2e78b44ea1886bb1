"""The built docs site in a headless browser at 1280 px: screenshots, and
no code example wider than its column.

Usage (after ``./bazelw build //docs:site``)::

    python3 tools/docs_screenshot.py bazel-bin/docs/site OUT_DIR [PAGE.html ...]

For each page (default: the index, getting started and every guide) it
writes ``OUT_DIR/<page>.png`` (Chromium ``--headless --screenshot`` at
``--window-size=1280,1600``) and measures, in the same browser and window
width, every ``<pre>`` block of the page: one whose content is wider than
its box (``scrollWidth > clientWidth``, i.e. a horizontal scroll bar) and a
page wider than the window are failures. Exit status 1 names them.

Needs a Chromium on the PATH (Debian: ``apt-get install chromium``); it runs
on the host, not inside Bazel, because the build's root has no browser.
"""

from __future__ import annotations

import glob
import html
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

__all__ = ["check_page", "main"]

WIDTH = 1280
HEIGHT = 1600

# Appended to a copy of each page: after load (fonts and the theme's CSS
# applied), the widths the check needs are written into an attribute of
# <body>, which --dump-dom prints.
_PROBE = """
<script>
window.addEventListener("load", () => {
  const wide = [...document.querySelectorAll("pre")]
    .filter((p) => p.scrollWidth > p.clientWidth + 1)
    .map((p) => ({first: p.textContent.split("\\n")[0].slice(0, 80), scroll: p.scrollWidth, box: p.clientWidth}));
  document.body.setAttribute("data-probe", JSON.stringify({
    pre: document.querySelectorAll("pre").length,
    wide: wide,
    page: document.documentElement.scrollWidth,
    window: window.innerWidth,
  }));
});
</script>
"""


def _browser() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    raise SystemExit("docs_screenshot: no chromium on the PATH (apt-get install chromium)")


def _chromium(browser: str, *args: str) -> str:
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           f"--window-size={WIDTH},{HEIGHT}", "--virtual-time-budget=5000", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout


def check_page(browser: str, site: str, page: str, out_dir: str) -> list[str]:
    """Screenshot ``page`` of ``site`` into ``out_dir``; the problems found."""
    path = os.path.join(site, page)
    png = os.path.join(out_dir, page.replace("/", "_").removesuffix(".html") + ".png")
    _chromium(browser, f"--screenshot={png}", "file://" + os.path.abspath(path))
    with open(path, encoding="utf-8") as f:
        text = f.read()
    # The probed copy sits beside the page so that its relative links resolve.
    fd, probed = tempfile.mkstemp(suffix=".html", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text.replace("</body>", _PROBE + "</body>"))
        dom = _chromium(browser, "--dump-dom", "file://" + probed)
    finally:
        os.unlink(probed)
    found = re.search(r'data-probe="([^"]*)"', dom)
    if not found:
        return [f"{page}: the probe did not run (no data-probe in the dumped DOM)"]
    probe = json.loads(html.unescape(found.group(1)))
    problems = [f"{page}: code example wider than its box ({w['scroll']} > {w['box']} px): {w['first']!r}"
                for w in probe["wide"]]
    if probe["page"] > probe["window"]:
        problems.append(f"{page}: the page is {probe['page']} px wide in a {probe['window']} px window")
    print(f"{page}: {probe['pre']} code blocks, {len(probe['wide'])} too wide; page {probe['page']} px "
          f"in {probe['window']} px; {png}")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    site, out_dir, pages = argv[0], argv[1], argv[2:]
    if not pages:
        guides = glob.glob(os.path.join(site, "guides", "*.html"))
        pages = ["index.html", "getting_started.html", *sorted(os.path.relpath(p, site) for p in guides)]
    os.makedirs(out_dir, exist_ok=True)
    browser = _browser()
    # A writable copy (Bazel's outputs are read-only): the probed pages go
    # beside the originals.
    with tempfile.TemporaryDirectory(prefix="docs-site-") as scratch:
        copy = shutil.copytree(site, os.path.join(scratch, "site"), copy_function=shutil.copyfile)
        for root, _dirs, _files in os.walk(copy):
            os.chmod(root, 0o700)
        problems = [p for page in pages for p in check_page(browser, copy, page, out_dir)]
    for problem in problems:
        print("FAIL", problem)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
