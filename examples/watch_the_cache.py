"""Watch the radix cache fill: start `arbor serve` with a small KV pool, run DSL programs
against it (support chats that share a system prompt and grow turn by turn, code reviews that
fork into reviewers) and open the dashboard it prints. `--screenshot PATH` saves a picture of
the page after `--seconds` and stops (Playwright and Chromium: `make install-browser`); how
docs/dashboard.png is made."""

from __future__ import annotations

import argparse
import random
import shutil
import threading
import time
from pathlib import Path

import frontend_lang as fl

SYSTEM = "You are the support assistant of a KV-cache library. Answer in one short paragraph."
QUESTIONS = [
    "Why did my request miss the cache?",
    "What does evictable mean?",
    "Can two users share a prefix?",
    "How do I size max_total_tokens?",
    "What happens when memory runs out?",
]
DIFFS = ["evict() now frees whole subtrees", "lock() walks to the root", "split keeps the tail"]


@fl.function
def support_chat(s: fl.ProgramState, questions: list[str], max_tokens: int = 32):
    """One conversation: every turn re-sends the history, which the cache already holds."""
    s += fl.system(SYSTEM)
    for turn, question in enumerate(questions):
        s += fl.user(question)
        s += fl.assistant(fl.gen(f"reply_{turn}", max_tokens=max_tokens))


@fl.function
def review(s: fl.ProgramState, diff: str, reviewers: int = 3, max_tokens: int = 32):
    """Reviewers fork from the same diff: their branches share its node in the tree."""
    s += f"Code review.\nDiff: {diff}\n"
    forks = s.fork(reviewers)
    for i, branch in enumerate(forks):
        branch += f"Reviewer {i + 1} says:" + fl.gen("verdict", max_tokens=max_tokens)
    forks.join()


def main(backend: fl.Backend, rounds: int = 1, max_tokens: int = 32, seed: int = 0) -> list:
    """``rounds`` of three conversations and one review, run concurrently; their states."""
    rng = random.Random(seed)
    states = []
    for _ in range(rounds):
        chats = [{"questions": rng.sample(QUESTIONS, 3), "max_tokens": max_tokens} for _ in "abc"]
        states += support_chat.run_batch(chats, backend=backend, progress_bar=False)
        states.append(review.run(diff=rng.choice(DIFFS), max_tokens=max_tokens, backend=backend))
    return states


def screenshot(url: str, path: Path) -> None:
    """Open the dashboard in headless Chromium, click the latest request, save a picture."""
    from playwright.sync_api import sync_playwright

    executable = shutil.which("chromium") or shutil.which("chromium-browser")
    if executable is None:
        raise SystemExit("no chromium on PATH: make install-browser")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=executable, headless=True, args=["--no-sandbox", "--disable-gpu"]
        )
        page = browser.new_page(viewport={"width": 1440, "height": 900})
        page.goto(f"{url}/dashboard")
        page.wait_for_function("() => Number(document.body.dataset.updates || 0) >= 20")
        page.locator("#requests tbody tr").first.click()
        page.wait_for_timeout(1200)  # an update with the path highlighted, animations done
        page.locator("#tree").evaluate("tree => { tree.scrollTop = 0; }")  # from the root
        page.screenshot(path=str(path))
        browser.close()


if __name__ == "__main__":
    from runtime.server import ServerProcess

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", help="GGUF file or model folder (default: built-in)")
    parser.add_argument("--max-total-tokens", default="3000", help="small, so the cache evicts")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--seconds", type=float, default=0, help="stop after (0: Ctrl-C)")
    parser.add_argument("--screenshot", type=Path, help="save a picture of the page, then stop")
    args = parser.parse_args()
    with ServerProcess(args.model_path, "--max-total-tokens", args.max_total_tokens) as server:
        print(f"dashboard: {server.url}/dashboard")
        stop = threading.Event()
        backend = fl.RuntimeEndpoint(server.url)

        def workload(seed: int) -> None:
            while not stop.is_set():
                main(backend, max_tokens=args.max_tokens, seed=seed)
                seed += 100

        workers = [threading.Thread(target=workload, args=(i,), daemon=True) for i in range(3)]
        for worker in workers:
            worker.start()
        try:
            if args.screenshot:
                time.sleep(args.seconds or 8)
                screenshot(server.url, args.screenshot)
                print(f"saved {args.screenshot}")
            elif args.seconds:
                time.sleep(args.seconds)
            else:
                threading.Event().wait()
        except KeyboardInterrupt:
            pass
        finally:
            stop.set()
            for worker in workers:
                worker.join(timeout=60)
            backend.shutdown()
