"""The chat page in a real browser: headless Chromium (Debian package ``chromium``) against a real ``z2all serve``.

The served model is written by hand (``scripted_model``): every reply is an endless run of ``<script>`` tags, the
worst thing a model could send a page, produced through the real tokenizer, server, stream and page code. The test
uses the keyboard only (text, Enter, Escape).
"""

import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from data_helpers import exported_tiny_model
from headless_chromium import Chromium, find_chromium
from scripted_model import scripted_model

from zero2all.tokenizer import load_tokenizer

pytestmark = pytest.mark.skipif(find_chromium() is None,
                                reason="needs a headless Chromium: install the Debian package 'chromium' "
                                       "(apt-get install chromium)")

KEY = "page-test-key-7d1"
PAYLOAD = "<script>"
CONTEXT = 4096


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``z2all serve`` of the scripted model on a free loopback port, with an API key from the environment."""
    d = exported_tiny_model(tmp_path_factory.mktemp("page"), random.Random(0))
    ckpt = scripted_model(load_tokenizer(d / "tok"), d / "tok", d / "scripted", PAYLOAD, max_seq_len=CONTEXT)
    log = open(d / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "zero2all.cli", "serve", "--ckpt", str(ckpt), "--port", "0",
                             "--device", "cpu", "--max-tokens-limit", str(2 * CONTEXT), "--model-name", "scripted"],
                            stdout=log, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "Z2ALL_API_KEY": KEY, "PYTHONPATH": str(Path(__file__).parents[1])})
    deadline = time.monotonic() + 180
    base = None
    while base is None and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
        log.seek(0)
        if found := re.search(r"chat page: (http://\S+)/", log.read()):
            base = found.group(1)
    log.seek(0)
    assert base, f"z2all serve did not start:\n{log.read()}"
    yield base
    proc.terminate()
    assert proc.wait(60) in (0, 143)
    log.close()


@pytest.fixture(scope="module")
def browser():
    b = Chromium()
    yield b
    b.close()


def health(base):
    return httpx.get(base + "/health", timeout=10).json()


def js_text(selector):
    return f"Array.from(document.querySelectorAll({json.dumps(selector)})).map(e => e.textContent)"


def test_chat_page_end_to_end(served, browser, tmp_path):
    b = browser
    b.goto(served + "/")
    # the key is asked for once, typed and submitted with the keyboard, kept in the tab only
    b.wait_for("document.getElementById('key-dialog').open", what="the API key dialog")
    b.type_text(KEY)
    b.press("Enter", key_code=13, text="\r")
    info = b.wait_for("(t => t.includes('context') && t)(document.getElementById('model-info').textContent)",
                      what="the model name and context")
    assert info == f"scripted · context {CONTEXT} tokens"
    assert b.evaluate("document.getElementById('max-tokens').max") == str(CONTEXT)  # the context, below the limit
    assert b.evaluate("sessionStorage.getItem('z2all-api-key')") == KEY
    assert b.evaluate("localStorage.getItem('z2all-api-key')") is None

    # a message with a code block, typed into the focused box and sent with Enter; greedy sampling, short reply
    b.evaluate("document.getElementById('temperature').value = '0'; document.getElementById('max-tokens').value"
               " = '24'; document.getElementById('system').value = 'You are terse.'")
    b.wait_for("document.activeElement.id === 'input'", timeout=5, what="the focus in the message box")
    b.type_text("Why does this print bold?\n```python\nprint('<b>hi</b>')\n```")
    b.press("Enter", key_code=13, text="\r")
    b.wait_for("document.querySelector('.message.assistant')?.dataset.finish", what="the first reply")
    replies = b.evaluate(js_text(".message.assistant .body"))
    assert replies[0].startswith(PAYLOAD * 2), replies  # the model's <script> tags arrived as text
    assert b.evaluate("document.querySelector('.message.assistant').dataset.finish") == "length"
    assert b.evaluate("document.querySelectorAll('#log script, #log img, #log b').length") == 0
    assert b.evaluate(js_text("#log code")) == ["print('<b>hi</b>')\n"]
    assert b.evaluate(js_text(".code-bar span")) == ["python"]
    # the copy button, reached and pressed with the keyboard, puts the code (not the fence) on the clipboard
    b.send("Browser.grantPermissions", {"origin": served, "permissions": ["clipboardReadWrite",
                                                                          "clipboardSanitizedWrite"]})
    b.evaluate("document.querySelector('.copy').focus()")
    b.press("Enter", key_code=13, text="\r")
    b.wait_for("document.querySelector('.copy').textContent === 'Copied'", what="the copy button")
    assert b.evaluate("navigator.clipboard.readText()") == "print('<b>hi</b>')\n"
    b.evaluate("document.getElementById('input').focus()")
    b.screenshot(tmp_path / "light.png")
    b.color_scheme("dark")
    assert b.evaluate("getComputedStyle(document.body).backgroundColor") == "rgb(21, 22, 26)"
    b.screenshot(tmp_path / "dark.png")
    b.color_scheme("light")
    if out := os.environ.get("Z2ALL_SCREENSHOTS"):  # regenerate the docs' images: Z2ALL_SCREENSHOTS=docs/img
        for name in ("light", "dark"):
            Path(out, f"chat-{name}.png").write_bytes((tmp_path / f"{name}.png").read_bytes())
    assert (tmp_path / "dark.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # a long reply: text streams in, Escape stops it, and the server frees the sequence's row at once. Max tokens
    # is the whole context, more than the conversation leaves: the page asks the server to fit it, not to refuse
    b.evaluate("document.getElementById('max-tokens').value = String(%d)" % CONTEXT)
    b.evaluate("document.getElementById('input').focus()")
    b.type_text("Again, at length.")
    b.press("Enter", key_code=13, text="\r")
    b.wait_for("(e => e && e.textContent.length > 40)(document.querySelectorAll('.message.assistant .body')[1])",
               what="streamed text in the second reply")
    assert health(served)["running"] == 1
    streamed = len(b.evaluate(js_text(".message.assistant .body"))[1])
    b.press("Escape", key_code=27)
    b.wait_for("document.querySelectorAll('.message.assistant')[1].dataset.finish", what="the stop")
    assert b.evaluate("document.querySelectorAll('.message.assistant')[1].dataset.finish") == "stopped"
    deadline = time.monotonic() + 5
    while health(served)["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert health(served) == {"status": "ok", "running": 0, "waiting": 0, "cancelled": 1}  # cut, not finished
    stopped = b.evaluate(js_text(".message.assistant .body"))[1]
    assert len(stopped) >= streamed and stopped.startswith(PAYLOAD)
    assert b.evaluate("document.getElementById('send').disabled") is False

    # reload: the conversation is gone, the key stays for this tab, nothing else is stored
    b.goto(served + "/")
    b.wait_for("document.getElementById('model-info').textContent.includes('context')", what="reconnect")
    assert b.evaluate("document.getElementById('key-dialog').open") is False
    assert b.evaluate("document.querySelectorAll('#log .message').length") == 0
    assert b.evaluate("document.getElementById('document').textContent") == ''
    assert b.evaluate("Object.keys(sessionStorage)") == ["z2all-api-key"]
    assert set(b.evaluate("Object.keys(localStorage)")) <= {"z2all-theme"}

    # completion mode for a base model: the prompt and what follows, both rendered as text
    b.evaluate("const m = document.getElementById('mode'); m.value = 'completion'; m.dispatchEvent(new Event("
               "'change')); document.getElementById('temperature').value = '0'; document.getElementById("
               "'max-tokens').value = '16'; document.getElementById('input').focus()")
    b.type_text("<img src=x onerror=alert(2)>")
    b.type_text("\n")
    b.press("Enter", key_code=13, text="\r")
    b.wait_for("document.getElementById('document').dataset.finish", what="the completion")
    text = b.evaluate("document.getElementById('document').textContent")
    assert text.startswith("<img src=x onerror=alert(2)>\n" + PAYLOAD), text
    assert b.evaluate("document.querySelectorAll('#document img, #document script').length") == 0
    assert health(served)["running"] == 0
    assert not [e for e in b.events if e.get("method") == "Page.javascriptDialogOpening"]  # no alert() ran
