#!/usr/bin/env python3
"""On-restore hook (clean marks only: clade runs on-restore hooks as part of hygiene, which a mark declared
not clean skips). Seed 000's browser hygiene: siblings restored from one checkpoint share the browser's
cookies, storage and V8 random state, so clear the default context's cookies and storage and replace the page
by the same page in a new browser context (a new renderer process, hence a new V8 isolate seeded after the
kernel's entropy was refreshed). The readiness check then waits for the new page to be titled and painted.
"""
import sys

sys.path.insert(0, "/srv/browser")
from cdp import CDP, browser_ws_url  # noqa: E402

PAGE = "file:///srv/browser/page.html"


def main():
    c = CDP(browser_ws_url())
    try:
        old = [t["targetId"] for t in c.send("Target.getTargets")["targetInfos"] if t.get("type") == "page"]
        c.send("Storage.clearCookies")
        ctx = c.send("Target.createBrowserContext")["browserContextId"]
        c.send("Target.createTarget", url=PAGE, browserContextId=ctx)
        for t in old:
            c.send("Target.closeTarget", targetId=t)
    finally:
        c.close()


if __name__ == "__main__":
    main()
