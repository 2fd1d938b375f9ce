"""Drives the admin dashboard (GET /) in a real headless Chromium, for tests/dashboard.rs.

Usage: dashboard.py ADMIN_URL MEMBER
1. Loads the page and waits until every number it shows matches GET /status (polled with a
   deadline: the page redraws on its own timer), a quota window's settled and reserved too.
2. Prints CHECKED, then waits for a line on stdin: the test has stopped MEMBER's upstream.
3. Waits until the page shows MEMBER down, and prints DOWN-SEEN.
Exits 3 when the browser or Selenium is missing (the test then skips, or fails with CI=true),
1 on any mismatch.
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

admin, member = sys.argv[1], sys.argv[2]


def status():
    with urllib.request.urlopen(f"{admin}/status", timeout=5) as r:
        return json.load(r)


# Reads the page in one script run: the page redraws every poll, so element handles kept
# across calls would go stale.
READ_PAGE = """
const STATUS_FIELDS = ["healthy", "cooling_ms", "assignments", "weight", "member_in_flight"];
const text = (root, sel) => root.querySelector(sel).textContent;
// A window: what is left, then settled and reserved ("-" when not shown).
const optional = (root, f) => { const e = root.querySelector(`[data-field=${f}]`); return e ? e.textContent : "-"; };
const win = w => [text(w, "[data-field=remaining]"), optional(w, "settled"), optional(w, "reserved")].join(" ");
const page = {};
for (const section of document.querySelectorAll("section[data-route]")) {
  const route = {
    requests: text(section, "[data-field=requests]"),
    in_flight: text(section, "[data-field=in_flight]"),
    waiting: text(section, "[data-field=waiting]"),
    members: {},
    quota: {},
  };
  for (const row of section.querySelectorAll("tr[data-member]")) {
    const fields = { quota: {} };
    // The fields /status holds (share and the countdown come from elsewhere: dashboard_charts.py).
    for (const f of row.querySelectorAll("[data-field]")) {
      if (!f.closest("[data-window]") && STATUS_FIELDS.includes(f.dataset.field)) {
        fields[f.dataset.field] = f.textContent;
      }
    }
    for (const w of row.querySelectorAll("[data-window]")) {
      fields.quota[w.dataset.window] = win(w);
    }
    route.members[row.dataset.member] = fields;
  }
  for (const w of section.querySelectorAll(".quota [data-window]")) {
    route.quota[w.dataset.window] = win(w);
  }
  page[section.dataset.route] = route;
}
return page;
"""


def shown(driver):
    """What the page shows, in the shape of /status's fields it displays."""
    return driver.execute_script(READ_PAGE)


def amount(n):
    """An amount as the page writes it: an integer as is, else up to 6 decimals."""
    if n is None:
        return "-"
    if float(n).is_integer():
        return str(int(n))
    return f"{n:.6f}".rstrip("0")


def window(w):
    return " ".join([str(w["remaining"]), amount(w.get("settled")), amount(w.get("reserved"))])


def expected(doc):
    want = {}
    for r in doc["routes"]:
        members = {}
        for m in r["members"]:
            fields = {"healthy": "up" if m["healthy"] else "down",
                      "cooling_ms": str(m.get("cooling_ms", "-")),
                      "quota": {w["name"]: window(w)
                                for w in m.get("quota", []) if "remaining" in w}}
            if "in_flight" in m:
                fields["member_in_flight"] = "?" if m["in_flight"] is None else str(m["in_flight"])
            if r["selection"] == "least_used":
                fields["assignments"] = str(m["assignments"])
            else:
                fields["weight"] = str(m["weight"])
            members[m["name"]] = fields
        want[r["name"]] = {
            "requests": str(r["requests"]),
            "in_flight": str(r["in_flight"]),
            "waiting": str(r["waiting"]),
            "members": members,
            "quota": {w["name"]: window(w) for w in r["quota"] if "remaining" in w},
        }
    return want


def until(what, condition):
    end = time.monotonic() + DEADLINE_S
    last = None
    while time.monotonic() < end:
        ok, last = condition()
        if ok:
            return
        time.sleep(0.1)
    print(f"FAILED: {what}; last seen: {last}", flush=True)
    sys.exit(1)


options = webdriver.ChromeOptions()
options.binary_location = CHROMIUM
for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
    options.add_argument(arg)
driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=options)
try:
    driver.get(f"{admin}/?interval_ms=200")

    def matches():
        page, want = shown(driver), expected(status())
        return page == want and len(want) > 0, {"page": page, "status": want}

    until("the page shows what /status says", matches)
    poll_error = driver.execute_script('return document.getElementById("poll_error").textContent')
    if poll_error:
        print(f"FAILED: the page reports {poll_error}", flush=True)
        sys.exit(1)
    print("CHECKED", flush=True)
    sys.stdin.readline()

    def down():
        page = shown(driver)
        health = [r["members"].get(member, {}).get("healthy") for r in page.values()]
        return "down" in health, health

    until(f"the page shows {member} down", down)
    print("DOWN-SEEN", flush=True)
finally:
    driver.quit()
