"""A real headless Debian `chromium`, driven over the Chrome DevTools Protocol with aiohttp's websocket client
(kvwatt's own dependency: no driver library).

    async with Chromium() as b:
        await b.goto("http://127.0.0.1:8492/")
        await b.text("#server-on [data-field=dE]")         # the rendered DOM's text
        await b.wait_for("document.title == 'kvwatt'")       # polls a JS expression, generous deadline
        await b.screenshot("page.png")                       # the whole page, as a person sees it

A missing chromium is an AssertionError naming the install step, never a skip (scripts/install-deps.sh
installs Debian's package).

Why not Playwright: docs/architecture.md "Tests", "The browser driver" (it drives Debian's chromium too, but
weighs 165 MB with its Node driver and supports only the Chromium build it bundles).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp

MISSING = ("chromium not found on PATH: the landing-page tests need Debian's headless chromium "
           "(scripts/install-deps.sh installs it: apt-get install chromium)")


def chromium_binary() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, MISSING
    return path


class Chromium:
    def __init__(self, width: int = 1280, height: int = 900, start_timeout: float = 60.0):
        self.width, self.height, self.start_timeout = width, height, start_timeout
        self.tmp = tempfile.TemporaryDirectory(prefix="kvwatt-chromium-")
        self.proc: subprocess.Popen | None = None
        self.session: aiohttp.ClientSession | None = None
        self.ws = None
        self.ids = itertools.count(1)

    async def __aenter__(self) -> "Chromium":
        profile = Path(self.tmp.name)
        # --no-sandbox: the tests run as root in a container, where chromium's sandbox cannot start
        self.proc = subprocess.Popen(
            [chromium_binary(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--disable-extensions", "--disable-background-networking", "--hide-scrollbars",
             "--remote-debugging-port=0", f"--user-data-dir={profile}",
             f"--window-size={self.width},{self.height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        port = await self._devtools_port(profile / "DevToolsActivePort")
        self.session = aiohttp.ClientSession()
        async with self.session.get(f"http://127.0.0.1:{port}/json/list") as r:
            pages = [t for t in await r.json() if t["type"] == "page"]
        assert pages, "chromium started without a page target"
        self.ws = await self.session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0)
        await self.send("Page.enable")
        await self.send("Runtime.enable")
        return self

    async def _devtools_port(self, path: Path) -> int:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"chromium exited with {self.proc.returncode} at start")
            try:
                return int(path.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                await asyncio.sleep(0.2)
        raise AssertionError(f"chromium gave no DevTools port in {self.start_timeout:.0f}s")

    async def __aexit__(self, *exc) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self.session is not None:
            await self.session.close()
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.tmp.cleanup()

    async def send(self, method: str, timeout: float = 60.0, **params) -> dict:
        """One DevTools command; events arriving meanwhile are dropped."""
        msg_id = next(self.ids)
        await self.ws.send_str(json.dumps({"id": msg_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            msg = await self.ws.receive(timeout=max(deadline - time.monotonic(), 0.1))
            if msg.type != aiohttp.WSMsgType.TEXT:
                raise AssertionError(f"DevTools connection closed during {method}: {msg}")
            data = json.loads(msg.data)
            if data.get("id") == msg_id:
                if "error" in data:
                    raise AssertionError(f"{method}: {data['error']}")
                return data.get("result", {})

    async def eval(self, expression: str):
        r = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise AssertionError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 60.0, what: str = ""):
        deadline = time.monotonic() + timeout
        while True:
            value = await self.eval(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what or expression}")
            await asyncio.sleep(0.25)

    async def goto(self, url: str, timeout: float = 60.0) -> None:
        await self.send("Page.navigate", url=url)
        await self.wait_for(f"document.readyState == 'complete' && location.href == {json.dumps(url)}",
                            timeout, f"{url} to load")

    async def text(self, selector: str) -> str | None:
        """The element's rendered text (innerText: what a person reads), None when no element matches."""
        return await self.eval(f"(e => e ? e.innerText : null)(document.querySelector({json.dumps(selector)}))")

    async def texts(self, selector: str) -> list[str]:
        return await self.eval(f"Array.from(document.querySelectorAll({json.dumps(selector)}), e => e.innerText)")

    async def screenshot(self, path: str | Path) -> bytes:
        """The whole page at the window's width (the viewport grown to the content's height)."""
        metrics = await self.send("Page.getLayoutMetrics")
        height = int(metrics["cssContentSize"]["height"]) + 1
        await self.send("Emulation.setDeviceMetricsOverride", width=self.width, height=height,
                        deviceScaleFactor=1, mobile=False)
        shot = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        await self.send("Emulation.clearDeviceMetricsOverride")
        data = base64.b64decode(shot["data"])
        Path(path).write_bytes(data)
        return data
