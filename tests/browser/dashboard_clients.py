"""Drives the admin dashboard (GET /) in a real headless Chromium, for
tests/clients_observability.rs: its clients table must show what GET /status says of each
client (counts, and what is left of its own quota windows), and the page must hold none of the
tokens given.

Usage: dashboard_clients.py ADMIN_URL TOKEN...
Prints CHECKED once every client row matches /status (polled with a deadline: the page redraws
on its own timer). Exits 3 when the browser or Selenium is missing (the test then skips, or
fails with CI=true), 1 on any mismatch.
"""
import json
import shutil
import sys
import time
import urllib.request

DEADLINE_S = 20


def missing(why):
    print(f"MISSING: {why}", flush=True)
    sys.exit(3)


try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
except ImportError as e:
    missing(f"selenium: {e}")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
if not CHROMIUM or not DRIVER:
    missing("chromium and chromedriver (Debian: apt-get install chromium chromium-driver)")

admin, tokens = sys.argv[1], sys.argv[2:]


def status():
    with urllib.request.urlopen(f"{admin}/status", timeout=5) as r:
        return json.load(r)


# Reads the clients table in one script run: the page redraws every poll.
READ_PAGE = """
const page = {};
for (const row of document.querySelectorAll("tr[data-client]")) {
  const fields = { routes: row.children[1].textContent, quota: {} };
  for (const f of row.querySelectorAll("[data-field]")) {
    if (f.dataset.field !== "rate" && !f.closest("[data-window]")) {
      fields[f.dataset.field] = f.textContent;
    }
  }
  for (const w of row.querySelectorAll("[data-window]")) {
    fields.quota[w.dataset.window] = w.querySelector("[data-field=remaining]").textContent;
  }
  page[row.dataset.client] = fields;
}
return page;
"""


def expected(doc):
    return {
        c["name"]: {
            "routes": ", ".join(c["routes"]) if "routes" in c else "-",
            "requests": str(c["requests"]),
            "denied": str(c["denied"]),
            "would_deny": str(c["would_deny"]),
            "quota": {w["name"]: str(w["remaining"]) for w in c.get("quota", []) if "remaining" in w},
        }
        for c in doc["clients"]["list"]
    }


options = webdriver.ChromeOptions()
options.binary_location = CHROMIUM
for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
    options.add_argument(arg)
driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=options)
try:
    driver.get(f"{admin}/?interval_ms=200")
    end = time.monotonic() + DEADLINE_S
    last = None
    while time.monotonic() < end:
        page, want = driver.execute_script(READ_PAGE), expected(status())
        last = {"page": page, "status": want}
        if page == want and len(want) > 1:
            break
        time.sleep(0.1)
    else:
        print(f"FAILED: the clients table shows what /status says; last seen: {last}", flush=True)
        sys.exit(1)
    text = driver.execute_script("return document.documentElement.outerHTML")
    leaked = [t for t in tokens if t in text]
    if leaked:
        print(f"FAILED: the page holds a token: {leaked}", flush=True)
        sys.exit(1)
    print("CHECKED", flush=True)
finally:
    driver.quit()
