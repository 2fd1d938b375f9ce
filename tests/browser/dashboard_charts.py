"""Drives the admin dashboard (GET /) in a real headless Chromium, for tests/dashboard.rs.

Usage: dashboard_charts.py ADMIN_URL SCREENSHOT
Prints each step's word once it holds (each polled with a deadline: the page redraws on its
own timer):
- CHARTS: every route's charts draw /status/history's series (the same sample, by its end),
  one point per value, and req/s is the history's rate;
- COUNTDOWN: the cooling member key-a of route keys shows a countdown that goes down;
- BAR-READ, then waits for a line on stdin (the test has sent requests to route metered), then
  BAR-MOVED: the quota bar of metered's window `hour` grew;
- NO-EXTERNAL: the page loaded nothing and links nothing outside the admin listener;
- SHOT: a screenshot saved at SCREENSHOT.
Exits 3 when the browser or Selenium is missing, 1 on any mismatch.
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

admin, screenshot = sys.argv[1], sys.argv[2]


def get(path):
    with urllib.request.urlopen(f"{admin}{path}", timeout=5) as r:
        return json.load(r)


# Reads every chart in one script run: the page redraws every poll.
READ_CHARTS = """
const page = {};
for (const section of document.querySelectorAll("section[data-route]")) {
  const charts = {};
  for (const chart of section.querySelectorAll("svg[data-chart]")) {
    const series = {};
    for (const path of chart.querySelectorAll("path[data-series]")) {
      const d = path.getAttribute("d");
      series[path.dataset.series] = {
        values: path.dataset.values,
        points: d ? d.split(" ").filter(t => /^[ML]/.test(t)).length : 0,
      };
    }
    charts[chart.dataset.chart] = { end_ms: Number(chart.dataset.endMs), series };
  }
  page[section.dataset.route] = {
    rate: section.querySelector("[data-field=rate]").textContent,
    charts,
  };
}
return page;
"""


def until(what, condition):
    end = time.monotonic() + DEADLINE_S
    last = None
    while time.monotonic() < end:
        ok, last = condition()
        if ok:
            return last
        time.sleep(0.1)
    print(f"FAILED: {what}; last seen: {last}", flush=True)
    sys.exit(1)


def values(series):
    """A series as the page writes it in data-values: missing values empty."""
    return ",".join("" if v is None else (str(int(v)) if float(v).is_integer() else repr(v))
                    for v in series)


def charts_match(driver):
    page, history = driver.execute_script(READ_CHARTS), get("/status/history")
    problems = []
    for h in history["routes"]:
        shown = page.get(h["name"])
        if shown is None:
            problems.append(f"{h['name']}: no section")
            continue
        if shown["rate"] != f"{h['rate']:.1f}":
            problems.append(f"{h['name']}: req/s {shown['rate']} != {h['rate']}")
        want = {
            "requests": {c: h["requests"][c] for c in h["requests"]
                         if c in ("2xx", "429", "5xx") or any(h["requests"][c])},
            "latency": {"p50": h["p50_ms"], "p99": h["p99_ms"]},
        }
        for name, series in want.items():
            chart = shown["charts"].get(name)
            if chart is None or chart["end_ms"] != history["end_ms"]:
                problems.append(f"{h['name']}/{name}: not the same sample yet")
                continue
            if set(chart["series"]) != set(series):
                problems.append(f"{h['name']}/{name}: series {set(chart['series'])}")
            for s, points in series.items():
                got = chart["series"].get(s, {})
                if got.get("values") != values(points):
                    problems.append(f"{h['name']}/{name}/{s}: {got.get('values')} != {values(points)}")
                drawn = sum(1 for v in points if v is not None)
                if got.get("points") != drawn:
                    problems.append(f"{h['name']}/{name}/{s}: {got.get('points')} points for {drawn} values")
    # Some points drawn, not only empty charts.
    has_data = any(any(h["requests"]["2xx"]) for h in history["routes"])
    return not problems and has_data and len(history["routes"]) > 0, problems


COUNTDOWN = """
const row = document.querySelector('section[data-route="keys"] tr[data-member="key-a"]');
const e = row && row.querySelector("[data-field=countdown]");
return e ? e.textContent : null;
"""

BAR = """
const w = document.querySelector('section[data-route="metered"] .quota [data-window="hour"]');
if (!w) return null;
return [...w.querySelectorAll(".bar > span")].reduce((s, e) => s + parseFloat(e.style.width), 0);
"""

EXTERNAL = """
const here = location.origin;
const loaded = performance.getEntriesByType("resource").map(e => e.name)
  .filter(n => !n.startsWith(here + "/"));
const linked = [...document.querySelectorAll("[src], [href], [action], [srcset]")]
  .map(e => e.outerHTML);
const html = document.documentElement.outerHTML;
const urls = (html.match(/(https?:|wss?:|ftp:)?\\/\\/[a-z0-9.-]+\\.[a-z]/gi) || []);
return { loaded, linked, urls };
"""

options = webdriver.ChromeOptions()
options.binary_location = CHROMIUM
for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
            "--window-size=1280,1400"):
    options.add_argument(arg)
driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=options)
try:
    driver.get(f"{admin}/?interval_ms=200")
    until("the charts draw /status/history", lambda: charts_match(driver))
    print("CHARTS", flush=True)

    def seconds(text):
        return float(text.split()[0]) if text else None

    start = until("key-a shows a countdown",
                  lambda: ((s := seconds(driver.execute_script(COUNTDOWN))) is not None
                           and 0 < s <= 60, s))
    until("key-a's countdown goes down",
          lambda: ((s := seconds(driver.execute_script(COUNTDOWN))) is not None
                   and 0 < s < start, (start, s)))
    print("COUNTDOWN", flush=True)

    before = until("metered's quota bar is drawn",
                   lambda: ((w := driver.execute_script(BAR)) is not None and w > 0, w))
    print("BAR-READ", flush=True)
    sys.stdin.readline()
    until("metered's quota bar grows", lambda: ((w := driver.execute_script(BAR)) is not None
                                                and w > before, (before, w)))
    print("BAR-MOVED", flush=True)

    found = driver.execute_script(EXTERNAL)
    if found["loaded"] or found["linked"] or found["urls"]:
        print(f"FAILED: the page refers outside: {found}", flush=True)
        sys.exit(1)
    print("NO-EXTERNAL", flush=True)

    # The whole page, charts drawn, for a person to look at.
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1280, max(800, height + 40))
    until("the page is drawn again", lambda: charts_match(driver))
    if not driver.save_screenshot(screenshot):
        print(f"FAILED: no screenshot at {screenshot}", flush=True)
        sys.exit(1)
    print("SHOT", flush=True)
finally:
    driver.quit()
