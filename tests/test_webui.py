"""The chat page at / and the offline /docs, in a real headless Chromium.

One `mlxserve serve` of the embedded model for the module, with an API key and two served
names; one browser whose DNS resolves nothing but 127.0.0.1, and whose every request is
checked to have gone to the server. Oracles: the official openai client (the page's
greedy answers and token counts), the server's /metrics (the running count, aborted
requests), the page's own localStorage read back after a reload.

Screenshots of the main states go to $MLXSERVE_TEST_ARTIFACTS/webui (default: the temp
directory's mlxserve-test-artifacts/webui), never into the repository.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from selenium import webdriver
from selenium.common.exceptions import NoAlertPresentException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import Select, WebDriverWait

from tests.paths import ROOT
from tests.server_harness import metric, read_metrics, start_server, wait_until

KEY = "sk-webui-test"
MODELS = ("smollm2", "smollm2-b")
STORAGE = "mlxserve.conversations.v1"
ARTIFACTS = (
    Path(
        os.environ.get("MLXSERVE_TEST_ARTIFACTS")
        or Path(tempfile.gettempdir()) / "mlxserve-test-artifacts"
    )
    / "webui"
)
WAIT = 120  # seconds: a loaded 2-core machine; never a pass/fail measure of speed


def browser_paths() -> tuple[str, str] | None:
    """(browser, chromedriver): Debian's chromium, or Google Chrome (macOS runners)."""
    names = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
    browser = next((p for p in map(shutil.which, names) if p), None)
    mac = "/Applications/Google Chrome.app/Contents/MacOS/Google Chrome"
    if browser is None and sys.platform == "darwin" and os.path.exists(mac):
        browser = mac
    driver = shutil.which("chromedriver")
    if driver is None and os.environ.get("CHROMEWEBDRIVER"):  # GitHub's runner images
        candidate = Path(os.environ["CHROMEWEBDRIVER"]) / "chromedriver"
        driver = str(candidate) if candidate.exists() else None
    return (browser, driver) if browser and driver else None


def require_browser() -> tuple[str, str]:
    paths = browser_paths()
    if paths is None:
        reason = "no chromium and chromedriver (apt-get install chromium chromium-driver)"
        # In CI (.ci/run installs them) the page's tests must run, never skip.
        if os.environ.get("CI") == "true" or os.environ.get("MLXSERVE_REQUIRE_CHROMIUM"):
            pytest.fail(f"CI / MLXSERVE_REQUIRE_CHROMIUM is set, but {reason}")
        pytest.skip(reason)
    return paths


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    require_browser()
    log = tmp_path_factory.mktemp("webui") / "server.log"
    args = ["--api-key", KEY, "--served-model-name", *MODELS, "--disable-log-stats"]
    s = start_server(args, log)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oracle(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=WAIT)


class Browser:
    """A headless Chromium that can reach only 127.0.0.1, and the URLs it asked for."""

    def __init__(self, downloads: Path) -> None:
        binary, driver = require_browser()
        options = webdriver.ChromeOptions()
        options.binary_location = binary
        for arg in (
            "--headless=new",
            "--no-sandbox",  # CI runs as root
            "--disable-dev-shm-usage",
            "--window-size=1200,760",
            "--force-prefers-color-scheme=light",
            # Every host name but 127.0.0.1 resolves to nothing: a CDN would fail to load.
            "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
        ):
            options.add_argument(arg)
        options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
        self.driver: WebDriver = webdriver.Chrome(options=options, service=Service(driver))
        self.driver.execute_cdp_cmd(
            "Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)}
        )
        self.downloads = downloads
        self.urls: list[str] = []

    def requested(self) -> list[str]:
        """Every URL the pages asked for so far (Chrome's network log)."""
        for entry in self.driver.get_log("performance"):
            message = json.loads(entry["message"])["message"]
            if message["method"] == "Network.requestWillBeSent":
                self.urls.append(message["params"]["request"]["url"])
        return self.urls

    def quit(self) -> None:
        self.driver.quit()


@pytest.fixture(scope="module")
def browser(server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    b = Browser(tmp_path_factory.mktemp("downloads"))
    yield b
    b.quit()


@pytest.fixture(autouse=True)
def only_local_requests(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test: no request of the page left the server (CDN, fonts, telemetry)."""
    yield
    if "browser" not in request.fixturenames:
        return
    b, s = request.getfixturevalue("browser"), request.getfixturevalue("server")
    outside = [u for u in b.requested() if not u.startswith((s.url + "/", "data:", "blob:"))]
    assert outside == []


@pytest.fixture
def driver(browser: Browser) -> WebDriver:
    return browser.driver


def screenshot(driver: WebDriver, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(ARTIFACTS / f"{name}.png"))


def wait(driver: WebDriver, predicate, timeout: float = WAIT):
    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: predicate())


def stored(driver: WebDriver) -> list[dict]:
    return driver.execute_script(f"return JSON.parse(localStorage.getItem('{STORAGE}') || '[]')")


def current(driver: WebDriver) -> dict:
    cid = driver.execute_script("return localStorage.getItem('mlxserve.currentConversation')")
    return next(c for c in stored(driver) if c["id"] == cid)


def last_answer(driver: WebDriver) -> WebElement:
    return driver.find_elements(By.CSS_SELECTOR, "#messages article.assistant")[-1]


def wait_answer(driver: WebDriver) -> WebElement:
    """The last answer once it stopped streaming."""
    wait(driver, lambda: last_answer(driver).get_attribute("data-state") not in (None, "streaming"))
    return last_answer(driver)


def set_field(driver: WebDriver, element_id: str, value: str) -> None:
    """Type into a settings field and leave it (its change event saves the settings)."""
    if not driver.find_element(By.ID, "settings").is_displayed():
        driver.find_element(By.ID, "settings-button").click()
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value, Keys.TAB)


def send(driver: WebDriver, text: str) -> None:
    if driver.find_element(By.ID, "settings").is_displayed():
        driver.find_element(By.ID, "settings-button").click()
    box = driver.find_element(By.ID, "prompt")
    box.send_keys(text, Keys.ENTER)


def greedy(oracle: openai.OpenAI, model: str, text: str, max_tokens: int):
    return oracle.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": text}],
        temperature=0,
        max_tokens=max_tokens,
    )


# ------------------------------------------------------------------------ the tests
def test_page_asks_for_the_key_then_lists_the_served_models(server, driver) -> None:
    driver.get(server.url + "/")
    dialog = driver.find_element(By.ID, "key-dialog")
    wait(driver, lambda: dialog.get_attribute("open") is not None)
    screenshot(driver, "api-key")
    driver.find_element(By.ID, "key-input").send_keys("wrong-key", Keys.ENTER)
    wait(driver, lambda: "refused" in driver.find_element(By.ID, "key-reason").text)
    assert dialog.get_attribute("open") is not None
    driver.find_element(By.ID, "key-input").send_keys(KEY, Keys.ENTER)
    served = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    names = [m["id"] for m in served["data"]]
    assert names == list(MODELS)
    picker = Select(driver.find_element(By.ID, "model-select"))
    wait(driver, lambda: len(picker.options) == len(names))
    assert [o.get_attribute("value") for o in picker.options] == names
    assert dialog.get_attribute("open") is None
    assert driver.execute_script("return localStorage.getItem('mlxserve.apiKey')") == KEY


def test_a_streamed_answer_is_the_apis_greedy_answer(driver, oracle) -> None:
    box = driver.find_element(By.ID, "prompt")
    box.send_keys("first line", Keys.SHIFT, Keys.ENTER, Keys.NULL, "second")
    assert box.get_attribute("value") == "first line\nsecond"  # Shift+Enter: no send
    assert driver.find_elements(By.CSS_SELECTOR, "#messages article") == []
    box.clear()
    set_field(driver, "temperature", "0")
    set_field(driver, "max-tokens", "12")
    question = "What is the capital of France?"
    send(driver, question)
    answer = wait_answer(driver)
    expected = greedy(oracle, MODELS[0], question, 12)
    message = current(driver)["messages"][-1]
    assert message["content"] == [{"type": "text", "text": expected.choices[0].message.content}]
    assert message["finish"] == expected.choices[0].finish_reason
    usage = expected.usage
    stats = answer.find_element(By.CLASS_NAME, "stats").text
    assert stats.startswith(f"{usage.completion_tokens} tokens")
    assert f"of {usage.prompt_tokens} prompt tokens cached" in stats
    assert "TTFT" in stats and "tok/s" in stats
    assert driver.find_element(By.ID, "conversation-title").text == question
    screenshot(driver, "answer")


def test_regenerate_and_edit_reuse_the_prefix_cache(driver, oracle) -> None:
    first = current(driver)["messages"][-1]
    last_answer(driver).find_element(By.XPATH, ".//button[text()='Regenerate']").click()
    wait_answer(driver)
    messages = current(driver)["messages"]
    assert len(messages) == 2
    assert messages[-1]["content"] == first["content"]  # greedy: the same answer
    assert messages[-1]["stats"]["cachedTokens"] > 0  # the same prompt: its blocks reused

    user = driver.find_elements(By.CSS_SELECTOR, "#messages article.user")[0]
    user.find_element(By.XPATH, ".//button[text()='Edit']").click()
    edit = driver.find_element(By.CSS_SELECTOR, "#messages .edit-box textarea")
    edit.clear()
    question = "What is the capital of Italy?"
    edit.send_keys(question, Keys.ENTER)
    wait(driver, lambda: current(driver)["messages"][0]["content"][0]["text"] == question)
    wait_answer(driver)
    messages = current(driver)["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"]
    expected = greedy(oracle, MODELS[0], question, 12).choices[0].message.content
    assert messages[1]["content"][0]["text"] == expected
    assert messages[1]["stats"]["cachedTokens"] > 0  # the system turn and template prefix


def test_stop_aborts_the_request_on_the_server(server, driver) -> None:
    driver.find_element(By.ID, "new-chat").click()
    set_field(driver, "max-tokens", "1500")
    # No end of text before Stop, however fast the machine (a field the page passes on).
    details = driver.find_element(By.CSS_SELECTOR, "#settings details")
    if details.get_attribute("open") is None:
        details.find_element(By.TAG_NAME, "summary").click()
    set_field(driver, "extra-fields", '{"ignore_eos": true}')
    aborted = metric(
        read_metrics(server.url),
        "vllm:request_success_total",
        model_name=MODELS[0],
        finished_reason="abort",
    )
    send(driver, "Write a very long story about a dragon who learns to bake bread.")
    # The answer is on the page while the server still generates it: it is streamed.
    wait(driver, lambda: len(last_answer(driver).find_element(By.CLASS_NAME, "body").text) > 20)
    assert last_answer(driver).get_attribute("data-state") == "streaming"
    running = metric(read_metrics(server.url), "vllm:num_requests_running", model_name=MODELS[0])
    assert running == 1
    screenshot(driver, "streaming")
    driver.find_element(By.ID, "stop").click()
    answer = wait_answer(driver)
    assert answer.get_attribute("data-state") == "stopped"
    assert answer.find_element(By.CLASS_NAME, "finish").text == "Stopped."

    def aborted_on_server() -> bool:
        values = read_metrics(server.url)
        return (
            metric(values, "vllm:num_requests_running", model_name=MODELS[0]) == 0
            and metric(
                values, "vllm:request_success_total", model_name=MODELS[0], finished_reason="abort"
            )
            == aborted + 1
        )

    assert wait_until(aborted_on_server, timeout=30)
    assert driver.find_element(By.ID, "send").is_displayed()
    screenshot(driver, "stopped")


def test_the_picker_switches_the_model(driver) -> None:
    driver.find_element(By.ID, "new-chat").click()
    Select(driver.find_element(By.ID, "model-select")).select_by_value(MODELS[1])
    set_field(driver, "max-tokens", "4")
    send(driver, "Hello!")
    answer = wait_answer(driver)
    assert answer.find_element(By.CLASS_NAME, "who").text == MODELS[1]
    conversation = current(driver)
    assert conversation["model"] == MODELS[1]
    assert conversation["messages"][-1]["model"] == MODELS[1]  # the name the server answered


SCHEMA = {
    "type": "object",
    "properties": {"capital": {"type": "string", "maxLength": 12}},
    "required": ["capital"],
    "additionalProperties": False,
}


def test_a_structured_answer_is_shown_as_indented_json(driver, oracle) -> None:
    """The answer schema box becomes response_format; the answer shows as a JSON block."""
    set_field(driver, "temperature", "0")
    set_field(driver, "max-tokens", "40")
    details = driver.find_element(By.CSS_SELECTOR, "#settings details")
    if details.get_attribute("open") is None:
        details.find_element(By.TAG_NAME, "summary").click()
    set_field(driver, "response-schema", json.dumps(SCHEMA))
    question = "What is the capital of Spain? Answer in JSON."
    send(driver, question)
    answer = wait_answer(driver)
    expected = oracle.chat.completions.create(
        model=MODELS[1],
        messages=[
            {"role": "user", "content": "Hello!"},
            {"role": "assistant", "content": current(driver)["messages"][1]["content"][0]["text"]},
            {"role": "user", "content": question},
        ],
        temperature=0,
        max_tokens=40,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": SCHEMA},
        },
    )
    text = expected.choices[0].message.content
    assert current(driver)["messages"][-1]["content"][0]["text"] == text
    code = answer.find_element(By.CSS_SELECTOR, ".body .code-block code")
    assert answer.find_element(By.CSS_SELECTOR, ".code-head span").text == "json"
    if expected.choices[0].finish_reason == "stop":  # complete JSON: indented
        shown = code.get_attribute("textContent")
        assert shown == json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    set_field(driver, "response-schema", "")


# What a reasoning model with tools streams (OpenAI's chunk format, vLLM's reasoning_content).
TOOL_STREAM = [
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    {"choices": [{"index": 0, "delta": {"reasoning_content": "The user wants "}}]},
    {"choices": [{"index": 0, "delta": {"reasoning_content": "the weather."}}]},
    {
        "choices": [
            {
                "index": 0,
                "delta": {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": ""},
                        }
                    ]
                },
            }
        ]
    },
    {
        "choices": [
            {
                "index": 0,
                "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
            }
        ]
    },
    {
        "choices": [
            {
                "index": 0,
                "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
            }
        ]
    },
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    {
        "choices": [],
        "usage": {
            "prompt_tokens": 50,
            "completion_tokens": 20,
            "total_tokens": 70,
            "prompt_tokens_details": {"cached_tokens": 32},
        },
    },
]


def test_reasoning_is_collapsed_and_tool_calls_are_readable(driver) -> None:
    """A stream of reasoning and a tool call (no model here produces one) from a stand-in
    for fetch: the page shows the reasoning collapsed and the call's arguments as JSON."""
    events = "".join(f"data: {json.dumps(c | {'model': MODELS[0]})}\n\n" for c in TOOL_STREAM)
    driver.execute_script(
        """
        const [events] = arguments;
        const real = window.fetch;
        window.fetch = (url, init) => {
          if (url !== "/v1/chat/completions") return real(url, init);
          window.fetch = real;  // once
          const body = new Blob([events + "data: [DONE]\\n\\n"]).stream();
          const headers = {"content-type": "text/event-stream"};
          return Promise.resolve(new Response(body, {headers}));
        };
        """,
        events,
    )
    driver.find_element(By.ID, "new-chat").click()
    send(driver, "What is the weather in Paris?")
    answer = wait_answer(driver)
    assert answer.get_attribute("data-state") == "tool_calls"
    reasoning = answer.find_element(By.CSS_SELECTOR, "details.reasoning")
    assert reasoning.get_attribute("open") is None  # collapsed
    assert reasoning.find_element(By.TAG_NAME, "summary").text == "Reasoning"
    assert reasoning.find_element(By.TAG_NAME, "div").get_attribute("textContent") == (
        "The user wants the weather."
    )
    call = answer.find_element(By.CLASS_NAME, "tool-call")
    assert call.find_element(By.TAG_NAME, "strong").text == "Tool call: get_weather"
    assert call.find_element(By.TAG_NAME, "pre").text == '{\n  "city": "Paris"\n}'
    assert answer.find_element(By.CLASS_NAME, "stats").text.startswith("20 tokens")
    assert "32 of 50 prompt tokens cached" in answer.find_element(By.CLASS_NAME, "stats").text
    screenshot(driver, "tool-call")
    driver.find_element(By.ID, "delete").click()
    WebDriverWait(driver, 10).until(lambda d: _alert(d)).accept()


def test_conversations_survive_a_reload_and_are_renamed_exported_deleted(browser, driver) -> None:
    before = stored(driver)
    assert len(before) == 3
    driver.find_element(By.ID, "rename").click()
    title = driver.find_element(By.ID, "title-input")
    title.send_keys("Greetings", Keys.ENTER)  # the old name is selected: typing replaces it
    driver.refresh()
    items = lambda: driver.find_elements(By.CSS_SELECTOR, "#conversation-list button")  # noqa: E731
    wait(driver, lambda: len(items()) == 3)
    assert driver.find_element(By.ID, "key-dialog").get_attribute("open") is None  # key kept
    assert items()[0].text == "Greetings"
    assert driver.find_element(By.ID, "conversation-title").text == "Greetings"
    edited = next(b for b in items() if b.text == "What is the capital of France?")
    edited.click()
    shown = [
        a.find_element(By.CLASS_NAME, "body").text
        for a in driver.find_elements(By.CSS_SELECTOR, "#messages article")
    ]
    conversation = current(driver)
    assert shown[0] == "What is the capital of Italy?"
    assert shown[1] == conversation["messages"][1]["content"][0]["text"].strip()
    assert driver.find_element(By.ID, "temperature").get_attribute("value") == "0"
    screenshot(driver, "reloaded")

    driver.find_element(By.ID, "export").click()
    path = browser.downloads / "What_is_the_capital_of_France_.json"
    assert wait_until(lambda: path.exists() and path.stat().st_size > 0, timeout=30)
    assert json.loads(path.read_text()) == conversation

    driver.find_element(By.ID, "delete").click()
    alert = WebDriverWait(driver, 10).until(lambda d: _alert(d))
    alert.accept()
    wait(driver, lambda: len(items()) == 2)
    driver.refresh()
    wait(driver, lambda: len(items()) == 2)
    assert {c["id"] for c in stored(driver)} == {c["id"] for c in before} - {conversation["id"]}


def _alert(driver: WebDriver):
    try:
        return driver.switch_to.alert
    except NoAlertPresentException:
        return False


def test_light_and_dark(driver) -> None:
    def background() -> str:
        return driver.execute_script("return getComputedStyle(document.body).backgroundColor")

    toggle = driver.find_element(By.ID, "theme-toggle")
    assert toggle.text == "Theme: system"
    assert background() == "rgb(255, 255, 255)"  # the browser prefers light
    toggle.click()
    assert toggle.text == "Theme: light"
    toggle.click()
    assert toggle.text == "Theme: dark"
    assert background() == "rgb(22, 24, 28)"
    screenshot(driver, "dark")
    driver.refresh()
    wait(driver, lambda: driver.find_element(By.ID, "theme-toggle").text == "Theme: dark")
    assert background() == "rgb(22, 24, 28)"
    driver.find_element(By.ID, "theme-toggle").click()
    assert background() == "rgb(255, 255, 255)"


MARKDOWN = """# Title

Some **bold**, *italic*, `<code>` and a [link](https://example.com/?a=1&b=2).
<img src=x onerror="window.pwned=1"> [bad](javascript:window.pwned=1)

- one
- two
  - nested

1. first
2. second

```python
print("<b>not bold</b>")

x = 1
```

| a | b |
|---|---|
| 1 | 2 |

> quoted
"""


def render(driver: WebDriver, text: str, cuts: list[int] | None = None) -> dict:
    """Run the page's Markdown module on ``text`` in the browser: the full render, and the
    incremental one fed the prefixes ending at ``cuts``."""
    script = """
    const [text, cuts, done] = arguments;
    import('/ui/markdown.js').then((md) => {
      const full = document.createElement('div');
      full.innerHTML = md.renderMarkdown(text);
      const live = document.createElement('div');
      const inc = new md.IncrementalMarkdown(live);
      for (const cut of cuts) inc.update(text.slice(0, cut));
      done({
        html: full.innerHTML,
        incremental: inc.stable.innerHTML + inc.tail.innerHTML,
        images: full.querySelectorAll('img, script, [onerror]').length,
        links: [...full.querySelectorAll('a')].map((a) => a.getAttribute('href')),
        code: [...full.querySelectorAll('pre code')].map((c) => c.textContent),
        copies: full.querySelectorAll('button.copy-code').length,
        pwned: window.pwned === 1,
      });
    });
    """
    return driver.execute_async_script(script, text, cuts or [len(text)])


def test_markdown_is_escaped_and_renders_incrementally(driver) -> None:
    import random

    out = render(driver, MARKDOWN)
    assert out["images"] == 0 and not out["pwned"]
    assert "&lt;img src=x onerror=" in out["html"]
    assert out["links"] == ["https://example.com/?a=1&b=2"]  # javascript: dropped
    assert out["code"] == ['print("<b>not bold</b>")\n\nx = 1']
    assert out["copies"] == 1
    for tag in (
        "<h1>Title</h1>",
        "<strong>bold</strong>",
        "<em>italic</em>",
        "<code>&lt;code&gt;</code>",
        "<ul><li>one</li>",
        "<ol><li>first",
        "<th>a</th>",
        "<td>1</td>",
        "<blockquote>",
    ):
        assert tag in out["html"], tag
    # Streamed in random pieces, the incremental render ends equal to the full one, also
    # when the text ends inside a code block or on its closing fence.
    rng = random.Random(34)
    for text in (MARKDOWN, MARKDOWN + "```js\nlet a = '<b>';\n\nlet b", MARKDOWN + "```\nx\n```"):
        full = render(driver, text)["html"]
        for _ in range(3):
            cuts = sorted(rng.sample(range(1, len(text)), 25)) + [len(text)]
            assert render(driver, text, cuts)["incremental"] == full


def test_docs_and_redoc_render_offline(server, driver) -> None:
    def texts(selector: str) -> list[str]:
        script = "return [...document.querySelectorAll(arguments[0])].map((e) => e.textContent)"
        return [t.replace("\u200b", "").strip() for t in driver.execute_script(script, selector)]

    driver.get(server.url + "/docs")
    paths = ".swagger-ui .opblock-summary-path"
    wait(driver, lambda: "/v1/chat/completions" in texts(paths))
    assert "/v1/models" in texts(paths)
    screenshot(driver, "docs")
    driver.get(server.url + "/redoc")
    wait(driver, lambda: "Chat Completions" in texts(".api-content h2"))
    screenshot(driver, "redoc")


def test_the_page_ships_in_the_package(tmp_path) -> None:
    """setup.py's package data puts every file of the page into the built package."""
    import subprocess

    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy(ROOT / name, src / name)
    for name in ("mlxserve", "metal"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "lib"
    subprocess.run(
        [sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(out)],
        cwd=src,
        check=True,
        capture_output=True,
    )
    page = ROOT / "mlxserve" / "server" / "ui"
    shipped = sorted(p.name for p in (out / "mlxserve" / "server" / "ui").iterdir())
    assert shipped == sorted(p.name for p in page.iterdir())
    assert {"index.html", "app.js", "markdown.js", "style.css"} <= set(shipped)
