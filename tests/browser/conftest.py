"""Fixtures of the real-browser tests: namespace, speech WAV, servers, Chromium, pages, artifacts."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from browser_harness import (DESKTOP, QUESTION, ROOT, HostNetwork, LoopbackNamespace, Server, chromium_args,
                             chromium_wrapper, make_speech_wav, missing_tools, new_tmp)

ARTIFACTS = Path(os.environ.get("RTC_AGENT_ARTIFACTS", ROOT / "artifacts"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.browser)


@pytest.fixture(scope="session")
def artifacts() -> Path:
    for sub in ("screenshots", "browser"):
        (ARTIFACTS / sub).mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="session")
def net() -> Iterator[LoopbackNamespace | HostNetwork]:
    missing = missing_tools()
    if missing:
        pytest.skip(f"browser tests need {', '.join(missing)} (scripts/setup.sh installs them as root)")
    try:
        from playwright.sync_api import sync_playwright  # noqa: F401
    except ImportError:
        pytest.skip("browser tests need the playwright package (pip install -e '.[test]')")
    ns = HostNetwork() if os.environ.get("RTC_AGENT_BROWSER_NO_NETNS") == "1" else LoopbackNamespace()
    yield ns
    ns.close()


@pytest.fixture(scope="session")
def workdir() -> Path:
    return new_tmp("rtc-agent-browser-")


@pytest.fixture(scope="session")
def speech_wav(workdir: Path) -> Path:
    return make_speech_wav(workdir)


class Servers:
    """Starts `rtc-agent serve` on a port of its own. The shared server lives for the session; one a test starts for
    itself is stopped when that test ends (each is four processes of 0.8-1.3 GB: seven at once do not fit the
    CI machine's memory)."""

    def __init__(self, net: Any, artifacts: Path) -> None:
        self.net, self.artifacts = net, artifacts
        self.shared: Server | None = None
        self.own: list[Server] = []

    def __call__(self, port: int, *extra: str) -> Server:
        log = self.artifacts / "browser" / f"server-{port}.log"
        log.unlink(missing_ok=True)
        server = Server(self.net, port, log, *extra).start()
        self.own.append(server)
        return server

    def stop_own(self) -> None:
        while self.own:
            self.own.pop().stop()


@pytest.fixture(scope="session")
def servers(net: Any, artifacts: Path) -> Iterator[Servers]:
    started = Servers(net, artifacts)
    yield started
    started.stop_own()
    if started.shared is not None:
        started.shared.stop()


@pytest.fixture
def start_server(servers: Servers) -> Iterator[Callable[..., Server]]:
    """Starts a server for this test (`start_server(port, *serve flags)`), stopped when the test ends."""
    yield servers
    servers.stop_own()


@pytest.fixture(scope="session")
def server(servers: Servers) -> Server:
    """The shared server (up to 4 calls)."""
    if servers.shared is None:
        log = servers.artifacts / "browser" / "server-18080.log"
        log.unlink(missing_ok=True)
        servers.shared = Server(servers.net, 18080, log).start()
    return servers.shared


@pytest.fixture(scope="session")
def playwright_instance() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        yield p


@pytest.fixture(scope="session")
def launch(playwright_instance: Any, net: Any, workdir: Path, speech_wav: Path) -> Iterator[Callable[..., Any]]:
    """Launches Chromium inside the namespace. deny_media: every camera/microphone request is refused;
    fake_devices=False: no fake camera and microphone (the namespace's machine has none); speech: the WAV its
    fake microphone loops (default: speech_wav)."""
    wrapper = chromium_wrapper(net, workdir)
    browsers: list[Any] = []

    def go(deny_media: bool = False, fake_devices: bool = True, speech: Path | None = None) -> Any:
        args = chromium_args(speech or speech_wav, deny_media=deny_media, fake_devices=fake_devices)
        browser = playwright_instance.chromium.launch(executable_path=str(wrapper), headless=True, args=args,
                                                      timeout=60_000)
        browsers.append(browser)
        return browser

    yield go
    for b in browsers:
        b.close()


@pytest.fixture(scope="session")
def browser(launch: Callable[..., Any]) -> Any:
    return launch()


@pytest.fixture(scope="session")
def asking_browser(launch: Callable[..., Any], workdir: Path) -> Any:
    """A Chromium whose fake microphone asks QUESTION again and again (the captions tests)."""
    return launch(speech=make_speech_wav(workdir, QUESTION, "question"))


@pytest.fixture
def new_page(browser: Any, artifacts: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., Any]]:
    """Opens pages in fresh contexts (fresh localStorage); on teardown they hang up and close. Console errors
    of the page are kept in artifacts/browser/<test>.console.txt."""
    contexts: list[Any] = []
    lines: list[str] = []

    def make(viewport: dict[str, int] = DESKTOP, the_browser: Any = None, **kw: Any) -> Any:
        ctx = (the_browser or browser).new_context(viewport=viewport, **kw)
        contexts.append(ctx)
        page = ctx.new_page()
        page.on("console", lambda m: lines.append(f"[{m.type}] {m.text}"))
        page.on("pageerror", lambda e: lines.append(f"[pageerror] {e}"))
        page.set_default_timeout(20_000)
        return page

    yield make
    for ctx in contexts:
        for page in ctx.pages:
            try:
                page.evaluate("window.rtcAgent && window.rtcAgent.hangup()")
            except Exception:
                pass
        ctx.close()
    (artifacts / "browser" / f"{request.node.name}.console.txt").write_text("\n".join(lines))
