"""Does the chat page stay responsive while a 10,000-token answer streams in?

Serves the page (mlxserve.server.webui) beside a stand-in /v1/chat/completions that streams
N tokens of Markdown (paragraphs, lists, and one long code block, the renderer's worst case:
a block that cannot be split) as fast as it can or at --rate tokens/s, then drives headless
Chromium (Debian's chromium + chromedriver) through the page and reports, from inside the
page: the main thread's longest stall (a 50 ms timer's worst lateness), the long tasks
(> 50 ms) the browser saw, and the time until the whole answer was drawn.

    python -m bench.webui_long_answer --tokens 10000 [--rate 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import threading
import time

import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from mlxserve.server.webui import add_webui_routes

MODEL = "stand-in"


def answer_tokens(n: int) -> list[str]:
    """n pieces of Markdown text, about one token each."""
    words = "the page draws each finished block once and only redraws the tail".split()
    out: list[str] = []
    code_at = n // 3
    while len(out) < n:
        i = len(out)
        if i == code_at:
            out += ["\n\n```python\n"] + [f"x_{k} = {k} * 2\n" for k in range(n // 4)] + ["```\n\n"]
        elif i % 97 == 0:
            out.append("\n\n## Part\n\n")
        elif i % 41 == 0:
            out.append("\n\n- a **list** item\n- another `item`\n\n")
        else:
            out.append(f" {words[i % len(words)]}")
    return out[:n]


def make_app(n: int, rate: float) -> FastAPI:
    app = FastAPI(docs_url=None, redoc_url=None)
    add_webui_routes(app)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat() -> StreamingResponse:
        async def events():
            for i, token in enumerate(answer_tokens(n)):
                chunk = {"model": MODEL, "choices": [{"index": 0, "delta": {"content": token}}]}
                yield f"data: {json.dumps(chunk)}\n\n"
                if rate:
                    await asyncio.sleep(1 / rate)
                elif i % 50 == 0:
                    await asyncio.sleep(0)
            usage = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": n + 5}
            last = {
                "model": MODEL,
                "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
            }
            yield f"data: {json.dumps(last)}\n\n"
            yield f"data: {json.dumps({'model': MODEL, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


PROBE = """
window.__lag = 0;
let last = performance.now();
setInterval(() => {
  const now = performance.now();
  window.__lag = Math.max(window.__lag, now - last - 50);
  last = now;
}, 50);
// The page draws in animation-frame callbacks: time each one.
window.__draws = [];
const raf = window.requestAnimationFrame.bind(window);
window.requestAnimationFrame = (callback) =>
  raf((t) => {
    const start = performance.now();
    callback(t);
    window.__draws.push(performance.now() - start);
  });
window.__long = [];
new PerformanceObserver((list) => {
  for (const e of list.getEntries()) window.__long.push(e.duration);
}).observe({ entryTypes: ["longtask"] });
"""


def main() -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=10_000)
    p.add_argument("--rate", type=float, default=0.0, help="tokens/s (0: as fast as possible)")
    p.add_argument("--port", type=int, default=18_791)
    args = p.parse_args()

    server = uvicorn.Server(
        uvicorn.Config(make_app(args.tokens, args.rate), port=args.port, log_level="warning")
    )
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or shutil.which("google-chrome")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    try:
        driver.get(f"http://127.0.0.1:{args.port}/")
        driver.execute_script(PROBE)
        start = time.monotonic()
        driver.find_element(By.ID, "prompt").send_keys("go", Keys.ENTER)
        WebDriverWait(driver, 600, poll_frequency=0.2).until(
            lambda d: d.execute_script(
                "const a = document.querySelector('article.assistant');"
                "return a && a.dataset.state !== 'streaming'"
            )
        )
        seconds = time.monotonic() - start
        lag, longs, draws, chars = driver.execute_script(
            "return [window.__lag, window.__long, window.__draws,"
            " document.querySelector('article.assistant .body').textContent.length]"
        )
    finally:
        driver.quit()
        server.should_exit = True
    print(
        json.dumps(
            {
                "tokens": args.tokens,
                "rate": args.rate or "max",
                "seconds_to_drawn": round(seconds, 2),
                "max_main_thread_stall_ms": round(lag, 1),
                "long_tasks": len(longs),
                "longest_task_ms": round(max(longs, default=0), 1),
                "draws": len(draws),
                "longest_draws_ms": sorted((round(d), i) for i, d in enumerate(draws))[-5:],
                "median_draw_ms": round(sorted(draws)[len(draws) // 2], 1) if draws else 0,
                "drawn_chars": chars,
            }
        )
    )


if __name__ == "__main__":
    main()
