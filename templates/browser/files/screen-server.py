#!/usr/bin/env python3
"""The browser template's in-sandbox server (port 9000).

GET /title          -> {"title": ..., "url": ...} of Chromium's page, from CDP's /json/list
GET /screenshot.png -> the X display as PNG (`import -window root`)
GET /ready          -> {"title", "differ_fraction", "ready"}: 200 when the screenshot differs from the blank
                       desktop in more than 10% of pixels AND the page has a title, else 503.
"""
import json
import os
import random
import signal
import subprocess
import sys
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

DISPLAY = ":99"
BLANK = "/run/clade-browser/blank.png"
CDP = "http://127.0.0.1:9222/json/list"
THRESHOLD = 0.10


def page():
    with urllib.request.urlopen(CDP, timeout=2) as r:
        tabs = [t for t in json.load(r) if t.get("type") == "page"]
    if not tabs:
        return {"title": "", "url": ""}
    return {"title": tabs[0].get("title", ""), "url": tabs[0].get("url", "")}


def screenshot():
    return subprocess.run(
        ["import", "-display", DISPLAY, "-window", "root", "png:-"], check=True, capture_output=True, timeout=10
    ).stdout


def differ_fraction(png):
    """Fraction of pixels that differ from the blank desktop (ImageMagick `compare -metric AE`)."""
    p = subprocess.run(
        ["compare", "-metric", "AE", BLANK, "png:-", "null:"], input=png, capture_output=True, timeout=10
    )
    # compare prints the count on stderr and exits 1 when the images differ; 2 is an error.
    if p.returncode == 2:
        raise RuntimeError(p.stderr.decode(errors="replace"))
    differing = float(p.stderr.split()[0])
    ident = subprocess.run(["identify", "-format", "%w %h", "png:-"], input=png, capture_output=True, check=True)
    w, h = (int(x) for x in ident.stdout.split())
    return differing / (w * h)


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
            elif self.path == "/screenshot.png":
                self.reply(200, screenshot(), "image/png")
            elif self.path == "/ready":
                info = page()
                frac = differ_fraction(screenshot())
                ready = frac > THRESHOLD and bool(info["title"])
                self.reply(200 if ready else 503, {**info, "differ_fraction": round(frac, 4), "ready": ready})
            else:
                self.reply(404, {"error": "GET /title, /screenshot.png or /ready"})
        except Exception as e:  # noqa: BLE001 - any failure is a 503 with its reason
            self.reply(503, {"error": str(e), "ready": False})

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
