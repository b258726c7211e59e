#!/bin/sh
# Runs once inside the booted sandbox when its base is built: waits until the session is agent-ready (the
# screenshot differs from the blank desktop and the page has a title), which also warms the readiness check
# into the base. One python process polls (under TCG a python start alone takes seconds); every 30 s it says
# what it sees, on stderr and on the console (the vm backend's console.log), as Chromium under TCG takes
# minutes to come up. Deadline: 30 minutes.
exec python3 - <<'PY'
import json, subprocess, sys, time, urllib.error, urllib.request

def say(msg):
    line = f"provision: {msg}"
    print(line, file=sys.stderr, flush=True)
    try:
        with open("/dev/console", "w") as c:
            c.write(line + "\n")
    except OSError:
        pass

t0 = time.monotonic()
last = -30.0
while time.monotonic() - t0 < 1800:
    try:
        with urllib.request.urlopen("http://127.0.0.1:9000/ready", timeout=120) as r:
            say(f"agent-ready after {time.monotonic() - t0:.1f} s: {r.read().decode()}")
            sys.exit(0)
    except urllib.error.HTTPError as e:
        state = e.read().decode(errors="replace")
    except Exception as e:  # noqa: BLE001 - not up yet
        state = repr(e)
    if time.monotonic() - last >= 30:
        last = time.monotonic()
        procs = subprocess.run(["ps", "-eo", "pid,etimes,rss,comm"], capture_output=True, text=True).stdout
        user = [" ".join(l.split()) for l in procs.splitlines()[1:] if len(l.split()) == 4 and l.split()[2] != "0"]
        say(f"{time.monotonic() - t0:.0f} s, /ready: {state[:300]}; processes (pid age rss name): {', '.join(user)[:800]}")
        files = subprocess.run(["sh", "-c", "ls -la /srv/browser; md5sum /srv/browser/page.html; head -c 120 /srv/browser/page.html"], capture_output=True, text=True)
        say("files: " + (files.stdout + files.stderr).replace(chr(10), " | ")[:600])
        dmesg = subprocess.run(["dmesg"], capture_output=True, text=True).stdout.splitlines()[-4:]
        say("dmesg: " + " | ".join(d[:200] for d in dmesg))
        try:
            sys.path.insert(0, "/srv/browser")
            from cdp import CDP
            with urllib.request.urlopen("http://127.0.0.1:9222/json/list", timeout=10) as r:
                ws = [t for t in json.load(r) if t.get("type") == "page"][0]["webSocketDebuggerUrl"]
            c = CDP(ws, timeout=20)
            res = c.send("Runtime.evaluate", expression="[document.readyState, document.title, location.href, document.documentElement.outerHTML.length, navigator.userAgent].join(' | ')")
            c.close()
            say(f"page: {json.dumps(res)[:300]}")
        except Exception as e:  # noqa: BLE001 - diagnostics only
            say(f"page: {e!r}")
        try:
            with open("/var/log/clade/chromium.log") as f:
                tail = [l for l in f.read().splitlines() if l.strip()][-3:]
            say("chromium.log: " + " | ".join(t[:200] for t in tail))
        except OSError:
            pass
    time.sleep(0.5)
say("the browser session did not become agent-ready in 30 minutes; see /var/log/clade/*.log")
for name in ("xvfb", "chromium", "screen"):
    try:
        with open(f"/var/log/clade/{name}.log") as f:
            say(f"{name}.log: {f.read()[-1500:]}")
    except OSError:
        pass
sys.exit(1)
PY
