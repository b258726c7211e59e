#!/usr/bin/env python3
"""The browser template's in-sandbox server (port 9000).

GET /title          -> {"title": ..., "url": ...} of Chromium's page, from CDP's /json/list
GET /screenshot.png -> the X display as PNG (ImageMagick `import -window root`; for people, seconds under load)
GET /ready          -> {"title", "differ_fraction[_at_least]", "ready"}: 200 when the screenshot differs from the blank
                       desktop in more than 10% of pixels AND the page has its own title (not the placeholder
                       Chrome shows while it loads) AND no browser hygiene is pending, else 503.
GET /random         -> {"target", "math_random": [3 draws], "python_random": [3 draws]}: Math.random() in the page's
                       main world (through CDP) and this server's own random.random(). Two siblings restored from
                       one mark draw the same numbers unless hygiene gave the page a new V8 isolate and reseeded
                       this server (seed 000's clone check; `ct-bench` compares them).
POST /hygiene       -> 202: clear the cookies and replace the page by the same page in a new browser context
                       (a new renderer, a new V8 isolate), in the background; /ready waits for it. Sent by the
                       on-restore hook on every restore of a clean mark (seed 000's browser hygiene).
POST /slot          -> 200 once the new browser context and its window are open (behind the page, on an empty
                       data: page), for the next restore's hygiene to load the page in. Sent by the pre-mark
                       hook before every clean mark.

The readiness screenshot is Xvfb's own framebuffer (`-fbdir`: the screen memory-mapped in a file, XWD format):
reading it is the screenshot, without an X round trip or a PNG encoder (`import` took ~2 s of a 2.4 s check on
this 2-core host). Pixels are compared 32 bits at a time: XOR of the two frames, zero words counted in C.
The agent polls /ready every 10 ms while the browser loads and paints on the same 2 cores, so a poll is
cheap: no pixels before the page has a title, and then bands of rows equal to the blank are skipped with a
memcmp and counting stops once 10% is passed (~2 ms instead of the full frame's ~30 ms of CPU; a restored
browser's hygiene reached ready 271 -> 193 ms p50, measured in a live sandbox).
"""
import array
import json
import mmap
import os
import random
import signal
import struct
import subprocess
import sys
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cdp import CDP, browser_ws_url  # noqa: E402

DISPLAY = ":99"
FRAMEBUFFER = "/tmp/clade-browser/Xvfb_screen0"
BLANK = "/tmp/clade-browser/blank.xwd"
PAGE = "file:///srv/browser/page.html"
CDP_LIST = "http://127.0.0.1:9222/json/list"
THRESHOLD = 0.10


def page():
    """Title and URL of the page: the one the last browser hygiene loaded, else the first one listed (the
    window prepared for the next hygiene is not it). Chrome lists a closed page for a while after closing
    it: without the hygiene's target, /ready could read the old page's title while the new one loads."""
    with HYGIENE_LOCK:
        loaded = HYGIENE.get("page")
    with urllib.request.urlopen(CDP_LIST, timeout=2) as r:
        tabs = [t for t in json.load(r) if t.get("type") == "page" and t.get("id") != SLOT.get("target")]
    if loaded is not None:
        tabs = [t for t in tabs if t.get("id") == loaded]
    if not tabs:
        return {"title": "", "url": ""}
    return {"title": tabs[0].get("title", ""), "url": tabs[0].get("url", "")}


def placeholder_title(title, url):
    """Whether `title` is what Chrome lists for a page whose document has no title yet: nothing, the URL, or
    a name made from it (`page.html` for file:///srv/browser/page.html, `data:text/html,`). Seen in a live
    sandbox while a page loads; without this check /ready answered 200 before the page had its own title.
    (A page whose real title is its own file name would never be ready: the template's page is not one.)"""
    if not title:
        return True
    return title in (url, url.split("://", 1)[-1]) or url.rstrip("/").rsplit("/", 1)[-1] == title


def screenshot():
    return subprocess.run(
        ["import", "-display", DISPLAY, "-window", "root", "png:-"], check=True, capture_output=True, timeout=30
    ).stdout


def pixels(path):
    """(width, height, pixels, colour mask of a pixel) of an XWD file of 32 bits per pixel (what Xvfb writes
    for depth 24; the fourth byte is padding and not compared). The pixels are a read-only mapping of the
    file: slicing it reads only the rows asked for."""
    with open(path, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    head = struct.unpack(">25I", data[:100])
    header_size, width, height, bpp, bytes_per_line, ncolors = head[0], head[4], head[5], head[11], head[12], head[19]
    mask = head[14] | head[15] | head[16]
    if bpp != 32 or bytes_per_line != width * 4:
        raise RuntimeError(f"{path}: {bpp} bits per pixel, {bytes_per_line} bytes per line: expected 32, {width * 4}")
    start = header_size + ncolors * 12
    if len(data) < start + bytes_per_line * height:
        raise RuntimeError(f"{path}: {len(data)} bytes, too short for {width}x{height}")
    return width, height, memoryview(data)[start : start + bytes_per_line * height], mask


_MASKS = {}


def _row_mask(mask, width):
    if (mask, width) not in _MASKS:
        _MASKS[(mask, width)] = int.from_bytes(struct.pack("<I", mask) * width, "little")
    return _MASKS[(mask, width)]


def _differing(now, blank, mask):
    """Pixels of one stretch of rows that differ (32-bit words, padding byte masked off)."""
    xor = (int.from_bytes(now, "little") ^ int.from_bytes(blank, "little")) & _row_mask(mask, len(now) // 4)
    words = array.array("I", xor.to_bytes(len(now), "little"))
    return len(words) - words.count(0)


def _frames():
    w, h, now, mask = pixels(FRAMEBUFFER)
    bw, bh, blank, _ = pixels(BLANK)
    if (w, h) != (bw, bh):
        raise RuntimeError(f"screen is {w}x{h}, the blank desktop {bw}x{bh}")
    return w, h, now, blank, mask


BAND = 16  # rows compared at once


def differs_more_than(threshold):
    """(decided, fraction seen): whether more than `threshold` of the pixels differ from the blank desktop.
    The readiness check runs every 10 ms while a browser paints on the same 2 cores, so it stops as soon as
    the answer is known: bands of rows equal to the blank cost a memcmp, and counting stops once the
    threshold is passed. The fraction is exact when the answer is no, a lower bound when it is yes."""
    w, h, now, blank, mask = _frames()
    need = threshold * w * h
    seen = 0
    step = BAND * w * 4
    for off in range(0, len(now), step):
        a, b = now[off : off + step], blank[off : off + step]
        if a == b:
            continue
        seen += _differing(a, b, mask)
        if seen > need:
            return True, seen / (w * h)
    return False, seen / (w * h)


# The window the next restore's hygiene loads the page in, prepared before a clean mark: {"context", "target"}.
SLOT = {}
SLOT_URL = "data:text/html,"


def prepare_slot():
    """A new browser context with one window on an empty data: page, maximized and kept behind the page's
    window. The restore's hygiene navigates it to the page: leaving a data: page for file:// changes site, so
    the page gets a new renderer process, and with it a V8 isolate seeded after the restore (the clone check
    of `ct-bench` compares two siblings' Math.random()). Creating the context and its window there and then
    was ~40 ms of the hygiene (POST /hygiene to the page's own title, p50 197 -> 154 ms in a live sandbox; a
    restore with hygiene 0.61x -> 0.41x of cold in `./x bench ct`, with the stricter /ready of the same day).
    The context holds nothing: a data: page has no storage and sets no cookies."""
    c = CDP(browser_ws_url(timeout=10), timeout=60)
    try:
        targets = c.send("Target.getTargets")["targetInfos"]
        if SLOT and any(t["targetId"] == SLOT["target"] for t in targets):
            return
        pages = [t["targetId"] for t in targets if t.get("type") == "page"]
        context = c.send("Target.createBrowserContext")["browserContextId"]
        target = c.send("Target.createTarget", url=SLOT_URL, browserContextId=context)["targetId"]
        window = c.send("Browser.getWindowForTarget", targetId=target)["windowId"]
        c.send("Browser.setWindowBounds", windowId=window, bounds={"windowState": "maximized"})
        for t in pages:  # the page's window back in front
            c.send("Target.activateTarget", targetId=t)
        SLOT.clear()
        SLOT.update(context=context, target=target)
    finally:
        c.close()


# Browser hygiene: None (nothing pending), "pending", or the error of the last attempt.
HYGIENE = {"state": None, "took_ms": None, "page": None}
HYGIENE_LOCK = threading.Lock()


def new_context():
    """Clear the cookies, open the page in a new browser context (in the window prepared before the mark when
    there is one, see prepare_slot), close the old pages. Under TCG with other guests beside it a CDP answer
    can take tens of seconds: generous timeouts, and three attempts before the failure is what /ready
    reports."""
    import time

    t0 = time.monotonic()
    state = None
    loaded = None
    for attempt in range(3):
        try:
            c = CDP(browser_ws_url(timeout=60), timeout=120)
            try:
                old = [t["targetId"] for t in c.send("Target.getTargets")["targetInfos"] if t.get("type") == "page"]
                slot = SLOT.get("target")
                SLOT.clear()  # used once, whatever happens
                c.send("Storage.clearCookies")
                if slot in old:
                    old.remove(slot)
                    session = c.send("Target.attachToTarget", targetId=slot, flatten=True)["sessionId"]
                    c.send_to(session, "Page.navigate", url=PAGE)
                    c.send("Target.activateTarget", targetId=slot)
                    c.send("Target.detachFromTarget", sessionId=session)
                    loaded = slot
                else:  # no window prepared (a mark taken without the pre-mark hook): a new context now
                    ctx = c.send("Target.createBrowserContext")["browserContextId"]
                    loaded = c.send("Target.createTarget", url=PAGE, browserContextId=ctx)["targetId"]
                for t in old:
                    c.send("Target.closeTarget", targetId=t)
            finally:
                c.close()
            state = None
            break
        except Exception as e:  # noqa: BLE001 - reported by /ready after the last attempt
            state = f"browser hygiene failed (attempt {attempt + 1} of 3): {e!r}"
            sys.stderr.write(f"screen-server: {state}\n")
    with HYGIENE_LOCK:
        HYGIENE.update(state=state, took_ms=round((time.monotonic() - t0) * 1000, 1), page=loaded)


def page_random():
    """Three Math.random() draws in the page (the one /ready looks at), and that page's target id."""
    with HYGIENE_LOCK:
        loaded = HYGIENE.get("page")
    c = CDP(browser_ws_url(timeout=10), timeout=30)
    try:
        pages = [
            t["targetId"]
            for t in c.send("Target.getTargets")["targetInfos"]
            if t.get("type") == "page" and t["targetId"] != SLOT.get("target")
        ]
        if not pages:
            raise RuntimeError("no page is open")
        target = loaded if loaded in pages else pages[0]
        session = c.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        r = c.send_to(session, "Runtime.evaluate", expression="[0, 1, 2].map(() => Math.random())", returnByValue=True)
        c.send("Target.detachFromTarget", sessionId=session)
    finally:
        c.close()
    return {"target": target, "math_random": r["result"]["value"], "python_random": [random.random() for _ in range(3)]}


class Handler(BaseHTTPRequestHandler):
    def reply(self, code, body, ctype="application/json"):
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        try:
            if self.path == "/title":
                self.reply(200, page())
            elif self.path == "/random":
                self.reply(200, page_random())
            elif self.path == "/screenshot.png":
                self.reply(200, screenshot(), "image/png")
            elif self.path == "/ready":
                with HYGIENE_LOCK:
                    pending = HYGIENE["state"]
                if pending is not None:
                    self.reply(503, {"ready": False, "hygiene": pending})
                    return
                info = page()
                if placeholder_title(info["title"], info["url"]):
                    # no title yet: not ready whatever the screen shows, and the pixels are not worth the CPU
                    self.reply(503, {**info, "ready": False})
                    return
                ready, frac = differs_more_than(THRESHOLD)
                key = "differ_fraction_at_least" if ready else "differ_fraction"
                self.reply(200 if ready else 503, {**info, key: round(frac, 4), "ready": ready})
            else:
                self.reply(404, {"error": "GET /title, /screenshot.png, /ready or /random; POST /hygiene"})
        except Exception as e:  # noqa: BLE001 - any failure is a 503 with its reason
            self.reply(503, {"error": str(e), "ready": False})

    def do_POST(self):
        if self.path == "/slot":
            try:
                prepare_slot()
                self.reply(200, {"slot": SLOT})
            except Exception as e:  # noqa: BLE001 - the pre-mark hook reports it; the mark goes on
                self.reply(503, {"error": repr(e)})
            return
        if self.path != "/hygiene":
            self.reply(404, {"error": "POST /hygiene or /slot"})
            return
        with HYGIENE_LOCK:
            HYGIENE.update(state="pending", took_ms=None)
        threading.Thread(target=new_context, daemon=True).start()
        self.reply(202, {"hygiene": "pending"})

    def log_message(self, fmt, *args):
        sys.stderr.write("screen-server: " + fmt % args + "\n")


def reseed(*_):
    """Hygiene: clade-agent signals registered processes on every restore (siblings must not share RNG state)."""
    random.seed(os.urandom(32))


if __name__ == "__main__":
    signal.signal(signal.SIGUSR1, reseed)
    os.makedirs("/run/clade/restore-signal.d", exist_ok=True)
    with open(f"/run/clade/restore-signal.d/{os.getpid()}", "w") as f:
        f.write(str(int(signal.SIGUSR1)))
    ThreadingHTTPServer(("0.0.0.0", 9000), Handler).serve_forever()
