"""Drive headless Chromium through the Chrome DevTools Protocol over a pipe (``--remote-debugging-pipe``).

Chromium reads JSON commands from its file descriptor 3 and writes replies and events to descriptor 4, each message
ended by a NUL byte: no websocket, no driver binary, nothing beyond the ``chromium`` package itself. One page is
opened and attached in "flat" mode (commands carry its ``sessionId``).
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import tempfile
import time

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    return next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)


class CDPError(RuntimeError):
    pass


class Chromium:
    """A headless Chromium with one page: ``goto``, ``evaluate``, ``wait_for``, keys, screenshots."""

    def __init__(self, executable: str | None = None, width: int = 1100, height: int = 760):
        executable = executable or find_chromium()
        if executable is None:
            raise FileNotFoundError("no chromium executable (Debian: apt-get install chromium)")
        self.profile = tempfile.mkdtemp(prefix="z2all-chromium-")
        cmd_read, self._cmd = os.pipe()   # we write commands, Chromium reads them on its fd 3
        self._events, ev_write = os.pipe()  # Chromium writes on its fd 4, we read

        def child_fds():  # in the child, before exec: move the two ends to 3 and 4 (kept by pass_fds)
            a, b = os.dup(cmd_read), os.dup(ev_write)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.process = subprocess.Popen(
            [executable, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--remote-debugging-pipe",
             f"--user-data-dir={self.profile}", f"--window-size={width},{height}", "about:blank"],
            pass_fds=(3, 4), preexec_fn=child_fds, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        os.close(cmd_read)
        os.close(ev_write)
        self._buffer, self._next_id, self.events = b"", 0, []
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.send("Target.closeTarget", {"targetId": self._first_other_page(target)})
        for domain in ("Page", "Runtime"):
            self.page(f"{domain}.enable")
        self.page("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 1,
                                                         "mobile": False})

    def _first_other_page(self, keep: str) -> str:
        pages = [t["targetId"] for t in self.send("Target.getTargets")["targetInfos"]
                 if t["type"] == "page" and t["targetId"] != keep]
        return pages[0] if pages else keep

    # -- protocol ---------------------------------------------------------------------------------------------
    def _read(self, timeout: float) -> dict | None:
        deadline = time.monotonic() + timeout
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._events], [], [], left)[0]:
                return None
            data = os.read(self._events, 1 << 20)
            if not data:
                raise CDPError("chromium exited")
            self._buffer += data
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def send(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = 30.0) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._cmd, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            reply = self._read(left)
            if reply is None:
                break
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise CDPError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)
        raise TimeoutError(f"{method}: no reply in {timeout} s")

    def page(self, method: str, params: dict | None = None, timeout: float = 30.0) -> dict:
        return self.send(method, params, self.session, timeout)

    # -- page helpers -----------------------------------------------------------------------------------------
    def goto(self, url: str, timeout: float = 30.0):
        self.events.clear()
        self.page("Page.navigate", {"url": url})
        deadline = time.monotonic() + timeout
        while not any(e.get("method") == "Page.loadEventFired" for e in self.events):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not load in {timeout} s")
            event = self._read(deadline - time.monotonic())
            if event is not None:
                self.events.append(event)

    def evaluate(self, expression: str, timeout: float = 30.0):
        """The value of a JavaScript expression (awaited when it is a promise)."""
        out = self.page("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True},
                        timeout)
        if "exceptionDetails" in out:
            details = out["exceptionDetails"]
            raise CDPError(f"{expression[:80]!r}: {details.get('exception', {}).get('description', details)}")
        return out["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0, what: str = ""):
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout} s for {what or expression}")
            time.sleep(0.05)

    def type_text(self, text: str):
        self.page("Input.insertText", {"text": text})

    def press(self, key: str, code: str | None = None, key_code: int = 0, text: str | None = None):
        """A key press, as a user's keyboard sends it (keyDown then keyUp) to the focused element."""
        down = {"type": "keyDown", "key": key, "code": code or key, "windowsVirtualKeyCode": key_code}
        if text is not None:
            down["text"] = text
        self.page("Input.dispatchKeyEvent", down)
        self.page("Input.dispatchKeyEvent", {"type": "keyUp", "key": key, "code": code or key,
                                             "windowsVirtualKeyCode": key_code})

    def color_scheme(self, scheme: str):
        self.page("Emulation.setEmulatedMedia", {"features": [{"name": "prefers-color-scheme", "value": scheme}]})

    def screenshot(self, path) -> bytes:
        data = base64.b64decode(self.page("Page.captureScreenshot", {"format": "png"})["data"])
        with open(path, "wb") as f:
            f.write(data)
        return data

    def close(self):
        try:
            self.send("Browser.close", timeout=5)
        except (CDPError, TimeoutError, OSError):
            pass
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        for fd in (self._cmd, self._events):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self.profile, ignore_errors=True)
