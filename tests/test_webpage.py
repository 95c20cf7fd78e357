"""The web chat page in headless Chromium, driven over the Chrome DevTools protocol (plain websockets).

Needs a Chromium binary (``/usr/bin/chromium``; Debian: ``apt-get install -y chromium``; or set
``SPECD_CHROMIUM``); skipped without one. The test types a message, clicks Send and watches the reply
stream into the page, then checks the text against in-process greedy generation.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import time
import urllib.request

import orjson
import pytest
from test_server import PROMPTS, engine, make_args  # noqa: F401  (fixtures)
from websockets.sync.client import connect

pytestmark = pytest.mark.timeout(150)

CHROMIUM = (
    os.environ.get("SPECD_CHROMIUM")
    or shutil.which("chromium")
    or shutil.which("chromium-browser")
    or shutil.which("google-chrome")
)
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--remote-debugging-port=0",
]
N_TOK = 120


class CDP:
    """Minimal Chrome DevTools protocol client for one page."""

    def __init__(self, ws_url: str):
        self.ws = connect(ws_url, max_size=None, open_timeout=20).__enter__()
        self.ids = itertools.count(1)

    def call(self, method: str, timeout: float = 20.0, **params):
        i = next(self.ids)
        self.ws.send(orjson.dumps({"id": i, "method": method, "params": params}).decode())
        end = time.monotonic() + timeout
        while True:
            m = orjson.loads(self.ws.recv(timeout=max(0.1, end - time.monotonic())))
            if m.get("id") == i:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})

    def js(self, expr: str):
        r = self.call("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expr}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait(self, expr: str, timeout: float = 30.0, every: float = 0.02):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            v = self.js(expr)
            if v:
                return v
            time.sleep(every)
        raise TimeoutError(expr)

    def click(self, selector: str):
        box = self.js(
            f"(() => {{ const r = document.querySelector({orjson.dumps(selector).decode()})"
            f".getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; }})()"
        )
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left", clickCount=1)

    def type(self, selector: str, text: str):
        self.js(f"document.querySelector({orjson.dumps(selector).decode()}).focus()")
        self.call("Input.insertText", text=text)

    def close(self):
        self.ws.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if CHROMIUM is None:
        pytest.fail("no Chromium: `make test` installs it (apt-get install -y chromium), or set SPECD_CHROMIUM")
    prof = tmp_path_factory.mktemp("chromium-profile")
    proc = subprocess.Popen(
        [CHROMIUM, *FLAGS, f"--user-data-dir={prof}", "about:blank"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        port_file = prof / "DevToolsActivePort"
        end = time.monotonic() + 60
        while not (port_file.exists() and len(port_file.read_text().split()) >= 2):
            if proc.poll() is not None or time.monotonic() > end:
                pytest.fail(f"chromium did not start (exit {proc.poll()})")
            time.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        end = time.monotonic() + 30
        while True:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
                pages = [t for t in orjson.loads(r.read()) if t.get("type") == "page"]
            if pages or time.monotonic() > end:
                break
            time.sleep(0.1)
        cdp = CDP(pages[0]["webSocketDebuggerUrl"])
        cdp.call("Runtime.enable")
        yield cdp
        cdp.close()
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def page_server(engine):  # noqa: F811
    from specd.serving.app import ServerThread

    started = []

    def start(**kw):
        s = ServerThread(make_args(**kw), engine).start()
        started.append(s)
        return s

    yield start
    engine.step_hook = None
    for s in started:
        s.stop()


def _reference(engine, text, n, **kw):  # noqa: F811
    from specd.sampling.params import SamplingParams

    ids = engine.tokenizer(text)["input_ids"]
    seq = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=n, **kw))[0]
    return engine.output_text(seq)


def _open_chat(cdp: CDP, srv):
    cdp.call("Page.navigate", url=f"http://127.0.0.1:{srv.port}/")
    cdp.wait("document.readyState === 'complete' && !!document.getElementById('send')")
    cdp.wait("document.getElementById('status').textContent.startsWith('connected')")
    cdp.js(
        f"document.getElementById('temperature').value = '0'; document.getElementById('maxtokens').value = "
        f"'{N_TOK}'; true"
    )


def test_the_page_sends_its_repetition_penalty(browser, page_server, engine):  # noqa: F811
    """The header's repetition penalty goes with each request: the reply is the engine's penalized one."""
    prompt = PROMPTS[0]
    want = _reference(engine, prompt, N_TOK, repetition_penalty=1.3)
    assert want != _reference(engine, prompt, N_TOK)
    srv = page_server()
    _open_chat(browser, srv)
    browser.js("document.getElementById('reppen').value = '1.3'; true")
    browser.type("#input", prompt)
    browser.click("#send")
    browser.wait("(() => { const m = document.querySelector('.msg.assistant');"
                 " return m && !m.classList.contains('streaming'); })()")  # fmt: skip
    assert browser.js("document.querySelector('.msg.assistant').firstChild.textContent") == want


def test_page_streams_a_reply(browser, page_server, engine):  # noqa: F811
    prompt = PROMPTS[0]
    want = _reference(engine, prompt, N_TOK)
    srv = page_server()
    engine.step_hook = lambda eng: time.sleep(0.01)  # slow steps a little so intermediate states are visible
    _open_chat(browser, srv)
    browser.type("#input", prompt)
    browser.click("#send")
    seen = set()
    end = time.monotonic() + 60
    while time.monotonic() < end:
        st = browser.js(
            "(() => { const a = document.querySelectorAll('.msg.assistant'); const m = a[a.length - 1];"
            " return m ? [m.firstChild ? m.firstChild.textContent || '' : '', "
            "m.classList.contains('streaming')] : null; })()"
        )
        if st:
            seen.add(st[0])
            if not st[1]:
                break
        time.sleep(0.01)
    engine.step_hook = None
    final = browser.js("document.querySelector('.msg.assistant').firstChild.textContent")
    assert final == want
    partial = [s for s in seen if s and s != want]
    assert partial, "no intermediate (streamed) state was observed"
    assert all(want.startswith(s) for s in partial)
    stats = browser.js("document.getElementById('stats').textContent")
    assert "tok/s" in stats and "tokens/step" in stats and "TTFT" in stats, stats
    assert browser.js("document.querySelectorAll('.msg.user').length") == 1
    assert browser.js("document.getElementById('input').value") == ""
    # second turn: the whole conversation goes out as messages
    browser.type("#input", "The end")
    browser.click("#send")
    browser.wait(
        "document.querySelectorAll('.msg.assistant').length === 2 && "
        "!document.querySelectorAll('.msg.assistant')[1].classList.contains('streaming')"
    )
    assert browser.js("messages.length") == 4
    assert browser.js("messages.map(m => m.role).join(',')") == "user,assistant,user,assistant"
    assert browser.js("document.querySelectorAll('.msg.error').length") == 0


def test_page_api_key(browser, page_server):
    srv = page_server(api_key="k3y")
    browser.call("Page.navigate", url=f"http://127.0.0.1:{srv.port}/")
    browser.wait("document.readyState === 'complete' && !!document.getElementById('send')")
    browser.wait("document.getElementById('status').textContent.startsWith('connected')")
    browser.js(
        "document.getElementById('apikey').value = 'k3y'; "
        "document.getElementById('apikey').dispatchEvent(new Event('change')); true"
    )
    browser.wait("document.getElementById('status').textContent === 'connected (key ok)'")
    browser.js("document.getElementById('maxtokens').value = '8'; true")
    browser.type("#input", PROMPTS[1])
    browser.click("#send")
    browser.wait(
        "document.querySelectorAll('.msg.assistant').length === 1 && "
        "!document.querySelector('.msg.assistant').classList.contains('streaming')"
    )
    assert browser.js("document.querySelectorAll('.msg.error').length") == 0
    assert browser.js("document.querySelector('.msg.assistant').firstChild.textContent")
    browser.js("sessionStorage.clear(); true")
