"""A real headless browser for tests: Debian's chromium (scripts/browser.sh installs it), driven over
the Chrome DevTools Protocol on a pipe (--remote-debugging-pipe: commands on fd 3, replies on fd 4,
each a JSON object ended by NUL), so no websocket library and no port are needed."""
from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

CANDIDATES = ("chromium", "chromium-browser", "google-chrome")


def find() -> Optional[str]:
    """The browser binary: $LAUNCHER_CHROMIUM, else the first of CANDIDATES on PATH."""
    env = os.environ.get("LAUNCHER_CHROMIUM")
    if env and Path(env).is_file():
        return env
    return next((p for p in map(shutil.which, CANDIDATES) if p), None)


class Browser:
    def __init__(self, binary: str, width: int = 1280, height: int = 1600) -> None:
        self._profile = tempfile.mkdtemp(prefix="launcher-chromium-")
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()

        def fds() -> None:  # the protocol's fixed descriptors in the child (the pipes may be 3 or 4 already)
            r, w = os.dup(to_chrome_r), os.dup(from_chrome_w)
            os.dup2(r, 3)
            os.dup2(w, 4)
            os.set_inheritable(3, True)
            os.set_inheritable(4, True)

        self.proc = subprocess.Popen(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
             f"--user-data-dir={self._profile}", f"--window-size={width},{height}", "--remote-debugging-pipe",
             "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            preexec_fn=fds, close_fds=False)  # fds 3 and 4 made by dup2 in the child, inheritable
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf = b""
        self._id = 0
        self.events: List[Dict[str, Any]] = []
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable", session=True)

    # ---- the protocol ---------------------------------------------------------------------------------
    def _read(self, timeout: float) -> Dict[str, Any]:
        import select

        deadline = time.monotonic() + timeout
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_chrome], [], [], left)[0]:
                raise TimeoutError("no reply from the browser")
            chunk = os.read(self._from_chrome, 1 << 16)
            if not chunk:
                raise RuntimeError("the browser closed its pipe: " + self.proc.stderr.read().decode()[-2000:])
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def call(self, method: str, params: Optional[Dict[str, Any]] = None, session: bool = False,
             timeout: float = 60.0) -> Dict[str, Any]:
        self._id += 1
        msg: Dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = self.session
        os.write(self._to_chrome, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._read(timeout)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method: str, timeout: float = 60.0) -> Dict[str, Any]:
        for i, e in enumerate(self.events):
            if e.get("method") == method:
                return self.events.pop(i)
        deadline = time.monotonic() + timeout
        while True:
            e = self._read(max(0.1, deadline - time.monotonic()))
            if e.get("method") == method:
                return e
            self.events.append(e)

    # ---- what a test asks -------------------------------------------------------------------------------
    def open(self, path: Path) -> None:
        self.events.clear()
        self.call("Page.navigate", {"url": Path(path).resolve().as_uri()}, session=True)
        self.wait_event("Page.loadEventFired")

    def evaluate(self, expression: str) -> Any:
        res = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session=True)
        return res.get("result", {}).get("value")

    def console_errors(self) -> List[str]:
        """Errors the page raised or logged since it was opened (console, exceptions, failed loads)."""
        out = []
        for e in self.events:
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append(" ".join(str(a.get("value", a.get("description"))) for a in p.get("args", [])))
            elif m == "Runtime.exceptionThrown":
                out.append(str(p.get("exceptionDetails", {}).get("text")))
            elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                out.append(str(p["entry"].get("text")))
        return out

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", {"format": "png"}, session=True)["data"]
        Path(path).write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=10)
        except Exception:  # already gone
            pass
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._to_chrome, self._from_chrome):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self._profile, ignore_errors=True)
