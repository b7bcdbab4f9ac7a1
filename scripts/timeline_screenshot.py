#!/usr/bin/env python3
"""The timeline screenshot of docs/timeline.md, from a real run: docs/images/timeline.png.

1. runs examples/shakespeare.py on 2 replicas under ``poprun-lite --timeline`` (a few
   steps; every step, data-loading and model span of the example, and the library's
   collectives and embedding phases inside them);
2. turns the trace into one HTML page with the Chrome trace viewer (catapult's
   ``tracing/bin/trace2html``: the viewer of ``chrome://tracing``, which reads the same
   JSON as Perfetto);
3. opens it in Chromium, driven headless by playwright-core (from the npm registry, into
   a temporary directory), finds ``step 3`` with the viewer's find box, frames it (``f``)
   and saves the screenshot.

Needs: the project's venv (scripts/_env.sh), Debian's chromium (``apt-get install
chromium``), node and npm, and a checkout of catapult (https://github.com/catapult-project/catapult;
``--catapult DIR`` or ``$CATAPULT``). Nothing is installed into the project::

    .venv/bin/python scripts/timeline_screenshot.py --catapult ~/src/catapult
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLAYWRIGHT = "playwright-core@1.65.1"

DRIVER = r"""
import { chromium } from 'playwright-core';
const [page_url, out, executable, find] = process.argv.slice(2);
const browser = await chromium.launch({ executablePath: executable, args: ['--no-sandbox'] });
const page = await browser.newPage({ viewport: { width: 1400, height: 620 } });
await page.goto(page_url);
await page.locator('input.tr-ui-find-control').waitFor();
await page.waitForTimeout(1500);                    // the viewer lays the tracks out
const search = page.locator('input.tr-ui-find-control');
await search.click();
await search.fill(find);                            // replica 0's and replica 1's slice
await page.waitForTimeout(1000);
await page.keyboard.press('Enter');                 // select the first
await page.waitForTimeout(1000);
await page.evaluate(() => document.activeElement.blur());
await page.keyboard.press('f');                     // frame the selection
await page.waitForTimeout(500);
await page.keyboard.press('s');                     // zoom out a little: its neighbours
await page.waitForTimeout(500);
await page.evaluate(() => {                         // undim the other slices, keep the selection
  const find = document.querySelector('input.tr-ui-find-control');
  find.value = '';
  find.dispatchEvent(new Event('input'));
  find.blur();
});
await page.waitForTimeout(1000);
await page.screenshot({ path: out, clip: { x: 0, y: 0, width: 1400, height: 226 } });  // the tracks
await browser.close();
"""


def run(cmd, **kw):
    print("+", " ".join(map(str, cmd)), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--catapult", type=Path, default=os.environ.get("CATAPULT"),
                   help="a checkout of catapult (default: $CATAPULT)")
    p.add_argument("--chromium", default="/usr/bin/chromium", help="the browser playwright drives")
    p.add_argument("--steps", type=int, default=8, help="steps of the example")
    p.add_argument("--find", default="step 3", help="the slice to frame")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "images" / "timeline.png")
    args = p.parse_args(argv)
    if args.catapult is None or not (Path(args.catapult) / "tracing" / "bin" / "trace2html").is_file():
        p.error("--catapult DIR (or $CATAPULT): a checkout of https://github.com/catapult-project/catapult")
    with tempfile.TemporaryDirectory(prefix="timeline-screenshot.") as tmp:
        tmp = Path(tmp)
        trace = tmp / "shakespeare-2-replicas.json"
        run([sys.executable, "-m", "popdist_lite_launcher", "--num-replicas", "2", "--timeout", "600",
             "--timeline", trace, sys.executable, ROOT / "examples" / "shakespeare.py", "--steps", str(args.steps),
             "--log-every", "1", "--sample-chars", "0"], cwd=ROOT)
        html = tmp / "trace.html"
        run([sys.executable, Path(args.catapult) / "tracing" / "bin" / "trace2html", trace, "--output", html])
        node = tmp / "node"
        node.mkdir()
        (node / "package.json").write_text('{"type": "module", "private": true}\n')
        run(["npm", "install", "--silent", "--no-audit", "--no-fund", "--prefix", node, PLAYWRIGHT])
        (node / "driver.mjs").write_text(DRIVER)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        run(["node", node / "driver.mjs", html.as_uri(), args.out.resolve(), args.chromium, args.find], cwd=node)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
