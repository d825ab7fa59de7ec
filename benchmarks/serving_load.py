"""Serving under load: a real Triton, closed-loop clients and open-loop Poisson arrivals, overload included.

    .venv/bin/python -m benchmarks.serving_load [--quick] [--model DIR] [--pages 48] [--repeats 3]
        [--clients 1,4,16,32] [--rates 0.5,1,3] [--duration 30] [--max-queue-size 32]

Starts Triton on free 127.0.0.1 ports over a model folder (default: the shipped base) with the
repository's admission limit, reads every page once alone (the reference each later answer must
equal, token for token: nothing lost or mixed up), then:

- closed loop: C clients each sending its next page as soon as the last one is answered, for C in
  ``--clients``;
- open loop: Poisson arrivals at ``--rates`` times the sustainable rate (the closed-loop throughput at
  16 clients, or the most clients run), each for ``--duration`` seconds; latency counts from the
  scheduled arrival, so a server that falls behind shows it.

For each: pages/s, tokens/s, p50/p95/p99 latency of the answered requests, and outcomes by kind
(``ok``, ``busy``: refused at once for a full queue, ``mismatch``: answered with another reading
than the page's own, ``error``), median and spread (min-max) over ``--repeats``; after the run,
whether the server still answers (``crashed`` otherwise). Writes ``<out>/serving_load.json`` and
``serving_load.png`` (latency against offered load). ``--quick`` (under 5 minutes here): 16 pages,
1/4/16 clients, 10-second open-loop phases, one repeat. Today's server decodes closed batches (a
request that arrives during a batch waits for all of it); the last line says what that gives.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from components.services.process import VAR_DIR
from deploy.triton.client import (
    DocMarkupClient,
    ServerBusyError,
    TranscriptionError,
    TritonUnavailableError,
    encode_image,
)


@dataclass
class Outcome:
    kind: str  # ok | busy | mismatch | error
    seconds: float
    tokens: int = 0


def send(client: DocMarkupClient, page: bytes, reference: list[int], max_new_tokens: int, since: float) -> Outcome:
    """One request; its latency counts from ``since`` (the send time, or a scheduled arrival)."""
    try:
        answer = client.transcribe(page, max_new_tokens=max_new_tokens)
    except ServerBusyError:
        return Outcome("busy", time.perf_counter() - since)
    except (TranscriptionError, TritonUnavailableError):
        return Outcome("error", time.perf_counter() - since)
    kind = "ok" if answer.token_ids == reference else "mismatch"
    return Outcome(kind, time.perf_counter() - since, len(answer.token_ids))


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def summarize(outcomes: list[Outcome], wall: float) -> dict:
    answered = [o for o in outcomes if o.kind == "ok"]
    latencies = [o.seconds for o in answered]
    kinds = {kind: sum(o.kind == kind for o in outcomes) for kind in ("ok", "busy", "mismatch", "error")}
    refusals = [o.seconds for o in outcomes if o.kind == "busy"]
    return {"requests": len(outcomes), "outcomes": kinds, "wall_s": round(wall, 3),
            "pages_per_s": round(len(answered) / wall, 3), "tokens_per_s": round(sum(o.tokens for o in answered) / wall, 1),
            **{f"p{q}_s": percentile(latencies, q) for q in (50, 95, 99)},
            "slowest_refusal_s": max(refusals) if refusals else None}


def closed_loop(client, pages, references, clients: int, per_client: int, max_new_tokens: int) -> dict:
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def worker(c: int) -> None:
        for i in range(per_client):
            index = (c * per_client + i) % len(pages)
            outcome = send(client, pages[index], references[index], max_new_tokens, time.perf_counter())
            with lock:
                outcomes.append(outcome)

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(worker, range(clients)))
    return summarize(outcomes, time.perf_counter() - started)


def open_loop(client, pages, references, rate: float, duration: float, seed: int, max_new_tokens: int) -> dict:
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t > duration:
            break
        arrivals.append(t)
    started = time.perf_counter()
    futures = []
    with ThreadPoolExecutor(max(4, min(256, len(arrivals)))) as pool:
        for i, at in enumerate(arrivals):
            delay = started + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            index = i % len(pages)
            futures.append(pool.submit(send, client, pages[index], references[index], max_new_tokens, started + at))
        outcomes = [f.result() for f in futures]
    return summarize(outcomes, time.perf_counter() - started) | {"offered_per_s": round(rate, 3)}


def spread(runs: list[dict], key: str) -> dict | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    if not values:
        return None
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4), "max": round(max(values), 4)}


def aggregate(runs: list[dict]) -> dict:
    keys = ("pages_per_s", "tokens_per_s", "p50_s", "p95_s", "p99_s", "slowest_refusal_s")
    kinds = {kind: sum(r["outcomes"][kind] for r in runs) for kind in runs[0]["outcomes"]}
    return {"repeats": len(runs), "outcomes": kinds, **{key: spread(runs, key) for key in keys}, "runs": runs}


def plot(open_results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted(open_results, key=float)
    offered = [open_results[r]["runs"][0]["offered_per_s"] for r in rates]
    figure, axis = plt.subplots(figsize=(6, 4))
    for q in ("p50_s", "p99_s"):
        axis.plot(offered, [(open_results[r][q] or {}).get("median") for r in rates], marker="o", label=q[:-2])
    axis.set_xlabel("offered load (pages/s)")
    axis.set_ylabel("latency of answered pages (s)")
    axis.set_title("Triton, closed batches: latency against offered load")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: the shipped base)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--pages", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clients", default="1,4,16,32")
    parser.add_argument("--per-client", type=int, default=6, help="requests each closed-loop client sends")
    parser.add_argument("--rates", default="0.5,1,3", help="open-loop rates, as multiples of the sustainable rate")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per open-loop phase")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--max-queue-size", type=int, default=32)
    parser.add_argument("--out", type=Path, default=VAR_DIR / "bench" / "serving_load")
    args = parser.parse_args(argv)
    if args.quick:
        args.pages, args.repeats, args.clients, args.duration, args.per_client = 16, 1, "1,4,16", 10.0, 4
    from benchmarks.decoding import benchmark_pages
    from components.training.pretrain import DEFAULT_OUT
    from deploy.triton.server import TritonPorts, start_triton

    model = Path(args.model) if args.model else DEFAULT_OUT
    dataset = benchmark_pages(args.pages)
    pages = [encode_image(dataset.load_image(page)) for page in dataset.pages()]
    clients = [int(c) for c in args.clients.split(",")]
    rates = [float(r) for r in args.rates.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"triton-load-{int(time.time())}"
    server = start_triton(str(model.resolve()), ports=TritonPorts.free(), name=name,
                          repository_dir=args.out / "model_repository", request_log_dir=args.out / "requests",
                          max_batch_size=args.max_batch_size, max_queue_size=args.max_queue_size)
    client = DocMarkupClient(server.http_url, server.grpc_url, timeout_s=600)
    started = time.perf_counter()
    try:
        alone = [client.transcribe(page, max_new_tokens=args.max_new_tokens, probe=True) for page in pages]
        references = [a.token_ids for a in alone]
        closed = {}
        for count in clients:
            runs = [closed_loop(client, pages, references, count, args.per_client, args.max_new_tokens)
                    for _ in range(args.repeats)]
            closed[str(count)] = aggregate(runs)
            print(f"[load] closed loop, {count} clients: {closed[str(count)]['pages_per_s']} pages/s, "
                  f"p99 {closed[str(count)]['p99_s']} s, outcomes {closed[str(count)]['outcomes']}", flush=True)
        anchor = str(16 if 16 in clients else max(clients))
        sustainable = closed[anchor]["pages_per_s"]["median"]
        opened = {}
        for multiple in rates:
            runs = [open_loop(client, pages, references, multiple * sustainable, args.duration, seed, args.max_new_tokens)
                    for seed in range(args.repeats)]
            opened[str(multiple)] = aggregate(runs)
            print(f"[load] open loop at {multiple}x the sustainable {sustainable:.2f} pages/s: "
                  f"{opened[str(multiple)]['pages_per_s']} pages/s answered, p99 {opened[str(multiple)]['p99_s']} s, "
                  f"outcomes {opened[str(multiple)]['outcomes']}", flush=True)
        crashed = 0 if client.ready() else 1
    finally:
        server.stop()
    tokens = [len(r) for r in references]
    result = {"model": str(model), "pages": len(pages), "tokens_per_page": {"min": min(tokens), "median": statistics.median(tokens),
                                                                            "max": max(tokens)},
              "max_batch_size": args.max_batch_size, "max_queue_size": args.max_queue_size, "closed_loop": closed,
              "open_loop": opened, "sustainable_pages_per_s": sustainable, "crashed": crashed,
              "seconds": round(time.perf_counter() - started, 1)}
    (args.out / "serving_load.json").write_text(json.dumps(result, indent=2))
    plot(opened, args.out / "serving_load.png")
    worst = opened[str(max(rates, key=float))]
    lost = sum(r["outcomes"]["mismatch"] + r["outcomes"]["error"] for r in (*closed.values(), *opened.values()))
    print(f"wrote {args.out / 'serving_load.json'} and serving_load.png ({result['seconds']:.0f} s)")
    print(f"closed batches at {anchor} clients: {closed[anchor]['pages_per_s']['median']:.2f} pages/s, p99 "
          f"{closed[anchor]['p99_s']['median']:.2f} s; at {max(rates, key=float)}x that rate: "
          f"{worst['outcomes']['busy']} refused, p99 of the answered {worst['p99_s']['median']:.2f} s; lost {lost}; "
          f"crashed {crashed}")
    return 0 if crashed == 0 and lost == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
