"""What a learner sees in JupyterLab: every notebook with widgets, in a real browser.

Debian's Chromium, driven by Playwright, opens each notebook that builds ipywidgets in a
JupyterLab started here (on a free localhost port, over a temporary copy of the course, with
JupyterLab's default settings but one: notebook windowing off, so every cell's prompt is in
the page), each in a workspace of its own, runs all cells, and checks: no error output anywhere, no
"Error displaying widget"; every figure widget (``labkit.viz.interactive_figure``) renders a
picture that is not blank and no traceback; moving each control changes what it shows, and
moving it back restores it exactly. A failure saves a screenshot and says where.

Needs Chromium (``apt-get install -y chromium``) and Playwright (``pip install -e ".[browser]"``);
CI installs both and runs it (``LABKIT_CI=1``) on 5 notebooks drawn per run (``PER_RUN``). Locally:
``LABKIT_BROWSER=1 pytest tests/test_browser.py`` (5 drawn) or ``LABKIT_BROWSER=all`` (every one).
"""

import io
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = next((p for p in ("/usr/lib/chromium/chromium", "/usr/bin/chromium") if Path(p).exists()), None)
WANTED = os.environ.get("LABKIT_BROWSER") in ("1", "all") or os.environ.get("LABKIT_CI") == "1"
RUN_ALL_LIMIT = 600   # seconds for one notebook's cells
CHANGE_LIMIT = 30     # seconds for a widget to redraw after a control moves
TOKEN = uuid.uuid4().hex  # the server's token: the browser logs in with it, the API calls carry it
CODE_PROMPTS = ".jp-CodeCell .jp-InputPrompt"   # "[3]:" ran, "[*]:" running, "[ ]:" not run
ERROR_OUTPUTS = ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"


def widget_notebooks() -> list[str]:
    found = []
    for folder in ("chapters", "labs"):
        for path in sorted((ROOT / folder).glob("*.ipynb")):
            cells = json.loads(path.read_text())["cells"]
            if any("ipywidgets" in "".join(c["source"]) for c in cells if c["cell_type"] == "code"):
                found.append(f"{folder}/{path.name}")
    return found


def missing_tools() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return 'Playwright is not installed (pip install -e ".[browser]")'
    if CHROMIUM is None:
        return "Chromium is not installed (apt-get install -y chromium)"
    return None


pytestmark = pytest.mark.skipif(not WANTED, reason="the real-browser widget test runs in CI; locally: "
                                "apt-get install -y chromium && pip install -e \".[browser]\" && "
                                "LABKIT_BROWSER=1 pytest tests/test_browser.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def jupyterlab(tmp_path_factory):
    problem = missing_tools()
    if problem:
        pytest.fail(f"the browser test was asked for but cannot run: {problem}")
    base = tmp_path_factory.mktemp("jupyterlab")
    course = base / "course"
    for name in ("chapters", "labs", "labkit"):
        shutil.copytree(ROOT / name, course / name, ignore=shutil.ignore_patterns("__pycache__", ".ipynb_checkpoints"))
    env = dict(os.environ, PYTHONPATH=str(course), JUPYTER_CONFIG_DIR=str(base / "config"),
               JUPYTER_DATA_DIR=str(base / "data"), JUPYTER_RUNTIME_DIR=str(base / "runtime"),
               JUPYTERLAB_SETTINGS_DIR=str(base / "settings"), JUPYTERLAB_WORKSPACES_DIR=str(base / "workspaces"),
               IPYTHONDIR=str(base / "ipython"))
    # The one setting changed from JupyterLab's defaults: notebook windowing off, so that every
    # cell's prompt is in the page and the test can tell which cells ran. It changes what the
    # browser draws, not how the kernel runs callbacks (commsOverSubshells stays at its default).
    tracker = base / "settings" / "@jupyterlab" / "notebook-extension" / "tracker.jupyterlab-settings"
    tracker.parent.mkdir(parents=True)
    tracker.write_text(json.dumps({"windowingMode": "none"}))
    for attempt in range(3):  # a port taken between our probe and the server's bind: try another
        port = free_port()
        log = open(base / f"server-{attempt}.log", "w")
        server = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ServerApp.port_retries=0",
             "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={TOKEN}", "--ServerApp.password=",
             "--ServerApp.allow_root=True", f"--ServerApp.root_dir={course}", "--LabApp.news_url=None",
             "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        if wait_for_port(port, server, 120):
            break
        stop(server)
    else:
        pytest.fail(f"JupyterLab did not start; see {base}/server-*.log")
    try:
        yield f"http://127.0.0.1:{port}", base
    finally:
        stop(server)


def wait_for_port(port: int, server, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end and server.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return True
        except OSError:
            time.sleep(0.3)
    return False


def stop(server) -> None:
    try:
        os.killpg(server.pid, 15)
        server.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(server.pid, 9)


@pytest.fixture(scope="module")
def browser(jupyterlab):
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
            "--disable-background-networking", "--disable-component-update"])
        yield chromium
        chromium.close()


# ----------------------------------------------------------------------------- helpers


def image_of(widget) -> bytes:
    return widget.locator(".widget-image").first.screenshot()


def not_blank(png: bytes) -> bool:
    from PIL import Image, ImageStat
    image = Image.open(io.BytesIO(png)).convert("L")
    return image.size[0] > 50 and image.size[1] > 50 and max(ImageStat.Stat(image).stddev) > 5


def shown(widget) -> tuple[bytes, str]:
    return image_of(widget), widget.locator(".widget-html").first.inner_text()


def wait_for(condition, seconds: float, what: str):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(what)


def controls_of(widget):
    """(kind, locator) of each control above the figure."""
    box = widget.locator(".widget-hbox").first
    found = []
    for handle in box.locator(".noUi-handle").all():
        found.append(("slider", handle))
    for select in box.locator("select").all():
        found.append(("select", select))
    for text in box.locator(".widget-text input").all():
        found.append(("text", text))
    return found


def move(kind: str, control, forward: bool) -> None:
    if kind == "slider":
        control.focus()
        control.press("ArrowRight" if forward else "ArrowLeft")
    elif kind == "select":
        options = control.locator("option").all_inner_texts()
        current = control.evaluate("s => s.selectedIndex")
        target = (current + 1) % len(options) if forward else (current - 1) % len(options)
        control.select_option(index=target)
    else:
        value = float(control.input_value())
        control.fill(str(value * 2 if forward else value / 2))
        control.press("Enter")


def shut_down_kernels(url: str) -> None:
    """Each notebook's kernel ends with its test, so a slow one cannot run on into the next."""
    headers = {"Authorization": f"token {TOKEN}"}
    with urllib.request.urlopen(urllib.request.Request(f"{url}/api/sessions", headers=headers), timeout=30) as reply:
        sessions = json.load(reply)
    for session in sessions:
        request = urllib.request.Request(f"{url}/api/sessions/{session['id']}", method="DELETE", headers=headers)
        urllib.request.urlopen(request, timeout=60).close()


def run_all_finished(page) -> bool:
    """Every code cell has run, or one stopped Run All with an error (reported below). Not
    merely "no cell is busy": that is also true in the moment before the first cell starts."""
    prompts = page.locator(CODE_PROMPTS).all_inner_texts()
    if any("[*]" in p for p in prompts):
        return False
    if all("[ ]" not in p for p in prompts):
        return True
    return page.locator(ERROR_OUTPUTS).count() > 0


def run_all(page, notebook: str) -> None:
    """Run > Run All Cells, from the menu bar (the menu can miss a click while JupyterLab
    is still laying out: try again)."""
    item = page.get_by_text("Run All Cells", exact=True)
    for _ in range(5):
        page.keyboard.press("Escape")
        page.get_by_role("menuitem", name="Run", exact=True).click()
        try:
            item.wait_for(state="visible", timeout=5_000)
            item.click()
            return
        except Exception:  # noqa: BLE001 - the menu did not open; try again
            time.sleep(1)
    raise AssertionError(f"{notebook}: could not open Run > Run All Cells")


# ----------------------------------------------------------------------------- the test


# A notebook's run here repeats its run under nbval (the same cells, the same launches), plus
# JupyterLab and Chromium: about a minute each on CI's 2 cores. A CI run checks PER_RUN of them,
# drawn from the run's seed (a new one each run, named in each skip; LABKIT_SEED replays it),
# so every notebook comes round within a few runs; LABKIT_BROWSER=all checks every one.
PER_RUN = 5


def sampled(notebooks: list[str]) -> list:
    if os.environ.get("LABKIT_BROWSER") == "all" or len(notebooks) <= PER_RUN:
        return notebooks
    import random
    seed = int(os.environ.get("LABKIT_SEED") or random.SystemRandom().randrange(2 ** 31))
    chosen = set(random.Random(f"{seed}/browser").sample(notebooks, PER_RUN))
    why = (f"not in this run's {PER_RUN} drawn from LABKIT_SEED={seed} ({', '.join(sorted(chosen))}); "
           "LABKIT_BROWSER=all checks every notebook")
    return [n if n in chosen else pytest.param(n, marks=pytest.mark.skip(reason=why)) for n in notebooks]


@pytest.mark.parametrize("notebook", sampled(widget_notebooks()))
def test_widgets_render_and_respond_in_jupyterlab(jupyterlab, browser, notebook, tmp_path):
    url, _ = jupyterlab
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    console_errors = []
    page.on("console", lambda m: console_errors.append(m.text) if m.type == "error" else None)
    try:
        # a workspace of its own, so JupyterLab does not reopen the notebooks of earlier tests
        page.goto(f"{url}/lab/workspaces/{uuid.uuid4().hex}/tree/{notebook}?reset&token={TOKEN}", wait_until="domcontentloaded")
        page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
        wait_for(lambda: "Idle" in page.locator(".jp-StatusBar-Widget, #jp-main-statusbar").first.inner_text(),
                 120, f"{notebook}: the kernel never became idle")
        run_all(page, notebook)
        wait_for(lambda: run_all_finished(page), RUN_ALL_LIMIT, f"{notebook}: Run All did not finish")
        wait_for(lambda: "Idle" in page.locator("#jp-main-statusbar").first.inner_text(), 60,
                 f"{notebook}: the kernel stayed busy after Run All")
        stderr = page.locator(ERROR_OUTPUTS).all_inner_texts()
        tracebacks = [t for t in stderr if "Traceback" in t or "Error" in t.split("\n")[0]]
        assert not tracebacks, f"{notebook}: error output: {tracebacks[0][-1500:]}"
        prompts = page.locator(CODE_PROMPTS).all_inner_texts()
        assert all("[ ]" not in p for p in prompts), f"{notebook}: some cells did not run: {prompts}"
        body = page.locator(".jp-Notebook").first.inner_text()
        assert "Error displaying widget" not in body, f"{notebook}: a widget failed to display"
        widgets = page.locator(".widget-vbox:has(> .widget-image)").all()
        for number, widget in enumerate(widgets):
            widget.scroll_into_view_if_needed()
            first = wait_for(lambda: (lambda s: s if not_blank(s[0]) else None)(shown(widget)), CHANGE_LIMIT,
                             f"{notebook}: figure widget {number} is blank")
            assert "Traceback" not in first[1], f"{notebook}: figure widget {number}: {first[1][:1500]}"
            for kind, control in controls_of(widget):
                move(kind, control, forward=True)
                moved = wait_for(lambda: (lambda s: s if s != first else None)(shown(widget)), CHANGE_LIMIT,
                                 f"{notebook}: figure widget {number}: moving a {kind} changed nothing")
                assert not_blank(moved[0]) and "Traceback" not in moved[1], \
                    f"{notebook}: figure widget {number} after moving a {kind}: {moved[1][:1500]}"
                move(kind, control, forward=False)
                wait_for(lambda: shown(widget) == first, CHANGE_LIMIT,
                         f"{notebook}: figure widget {number}: moving the {kind} back did not restore the figure")
        assert not [e for e in console_errors if "widget" in e.lower()], \
            f"{notebook}: browser console errors: {console_errors[:5]}"
    except BaseException:
        shot = tmp_path / (notebook.replace("/", "_") + ".png")
        page.screenshot(path=str(shot), full_page=True)
        print(f"screenshot of the failure: {shot}")
        raise
    finally:
        page.close()
        shut_down_kernels(url)
