"""Serving under load: closed batches vs continuous batching on real Tritons, overload included.

    .venv/bin/python -m benchmarks.serving_load [--quick] [--model DIR] [--pages 48] [--repeats 3]
        [--clients 1,4,16,32] [--rates 0.5,1,3] [--duration 30] [--max-queue-size 32]

Starts two Tritons on free 127.0.0.1 ports over the same model folder (default: the shipped base),
one per contender: ``closed`` (each execute decodes its dynamically batched requests to the end: a
request that arrives during a batch waits for all of it) and ``continuous`` (an engine loop every
request joins at the next step; ``deploy/triton/backend.py``). Both have the same rows (8) and
admission limit. Every page is read once alone (the reference each later answer must equal, token
for token: nothing lost or mixed up); then, each measurement run for both contenders back to back
(their order alternating from repeat to repeat), on one loaded server at a time:

- closed loop: C clients each sending its next page as soon as the last one is answered, for C in
  ``--clients``;
- open loop: Poisson arrivals at ``--rates`` times the sustainable rate (the closed batches'
  throughput at 16 clients, or the most clients run), each for ``--duration`` seconds; latency
  counts from the scheduled arrival, so a server that falls behind shows it;
- short behind long: the 7 longest pages sent at once, the shortest one 50 ms later; its latency
  over its latency alone;
- time to first streamed commit at 16 concurrent streams (gRPC).

For each: pages/s, tokens/s, p50/p95/p99 latency of the answered requests, and outcomes by kind
(``ok``, ``busy``: refused at once for a full queue, ``mismatch``: answered with another reading
than the page's own, ``error``), median and spread (min-max) over ``--repeats``; after the run,
whether each server still answers (``crashed`` otherwise). Writes ``<out>/serving_load.json`` and
``serving_load.png`` (latency against offered load, both contenders). ``--quick`` (under 5 minutes
here): 16 pages, 1/16 clients, 1x and 3x for 8 seconds, one repeat. The last line:
``continuous/closed at 16 clients: throughput X.XXx, p99 Y.YYx; lost 0; crashed 0``.
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

from benchmarks.decoding import benchmark_pages
from components.services.process import VAR_DIR
from deploy.triton.client import (
    DocMarkupClient,
    ServerBusyError,
    TranscriptionError,
    TritonUnavailableError,
    encode_image,
)
from deploy.triton.server import TritonPorts, start_triton
from recipes.pretrain import DEFAULT_OUT


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
    except (TranscriptionError, TritonUnavailableError, OSError, RuntimeError):  # a dropped connection too
        return Outcome("error", time.perf_counter() - since)
    kind = "ok" if answer.token_ids == reference else "mismatch"
    return Outcome(kind, time.perf_counter() - since, len(answer.token_ids))


def first_commit(client: DocMarkupClient, page: bytes, reference: list[int], max_new_tokens: int) -> Outcome:
    """One streamed page; ``seconds``: until its first commit arrived (the answer is still checked)."""
    since = time.perf_counter()
    first = None
    tokens: list[int] = []
    try:
        for chunk in client.stream_transcribe(page, max_new_tokens=max_new_tokens):
            if first is None and chunk.token_ids:
                first = time.perf_counter() - since
            tokens.extend(chunk.token_ids)
    except ServerBusyError:
        return Outcome("busy", time.perf_counter() - since)
    except (TranscriptionError, TritonUnavailableError):
        return Outcome("error", time.perf_counter() - since)
    return Outcome("ok" if tokens == reference else "mismatch", first or 0.0, len(tokens))


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


def short_behind_long(client, pages, references, max_new_tokens: int) -> dict:
    """The shortest page sent 50 ms after the 7 longest: its latency over its latency alone."""
    order = sorted(range(len(pages)), key=lambda i: len(references[i]))
    short, longs = order[0], order[-7:]
    alone = send(client, pages[short], references[short], max_new_tokens, time.perf_counter())
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(send, client, pages[i], references[i], max_new_tokens, time.perf_counter()) for i in longs]
        time.sleep(0.05)
        behind = send(client, pages[short], references[short], max_new_tokens, time.perf_counter())
        others = [f.result() for f in futures]
    outcomes = [alone, behind, *others]
    return {"short_tokens": len(references[short]), "long_tokens": [len(references[i]) for i in longs],
            "alone_s": round(alone.seconds, 4), "behind_s": round(behind.seconds, 4),
            "ratio": round(behind.seconds / alone.seconds, 3),
            "outcomes": {kind: sum(o.kind == kind for o in outcomes) for kind in ("ok", "busy", "mismatch", "error")}}


def streamed_first_commit(client, pages, references, streams: int, max_new_tokens: int) -> dict:
    with ThreadPoolExecutor(streams) as pool:
        outcomes = list(pool.map(lambda i: first_commit(client, pages[i % len(pages)], references[i % len(pages)],
                                                        max_new_tokens), range(streams)))
    firsts = [o.seconds for o in outcomes if o.kind == "ok"]
    return {"streams": streams, **{f"first_commit_p{q}_s": percentile(firsts, q) for q in (50, 99)},
            "outcomes": {kind: sum(o.kind == kind for o in outcomes) for kind in ("ok", "busy", "mismatch", "error")}}


def plot(results: dict, path: Path) -> None:
    import matplotlib  # deferred: plotting only, with the Agg backend chosen first

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: plotting only, with the Agg backend chosen first

    figure, axis = plt.subplots(figsize=(6, 4))
    for name, result in results.items():
        opened = result["open_loop"]
        rates = sorted(opened, key=float)
        offered = [opened[r]["runs"][0]["offered_per_s"] for r in rates]
        for q, style in (("p50_s", "--"), ("p99_s", "-")):
            axis.plot(offered, [(opened[r][q] or {}).get("median") for r in rates], style, marker="o",
                      label=f"{name} {q[:-2]}")
    axis.set_xlabel("offered load (pages/s)")
    axis.set_ylabel("latency of answered pages (s)")
    axis.set_title("Triton: closed batches vs continuous batching")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def fmt(stat: dict | None, digits: int = 2) -> str:
    if not stat:
        return "–"
    return f"{stat['median']:.{digits}f}"


def markdown_table(result: dict) -> str:
    """The docs' table: each load, closed batches beside continuous batching (medians over repeats)."""
    closed, continuous = result["contenders"]["closed"], result["contenders"]["continuous"]
    lines = ["| load | closed pages/s | continuous pages/s | ratio | closed p50 / p99 s | continuous p50 / p99 s "
             "| refused closed / continuous | lost or mixed up |", "| --- " * 8 + "|"]
    phases = [(f"{c} client{'s' if c != '1' else ''}", "closed_loop", c) for c in closed["closed_loop"]]
    for multiple in closed["open_loop"]:
        offered = closed["open_loop"][multiple]["runs"][0]["offered_per_s"]
        phases.append((f"Poisson {float(multiple):g}× ({offered:.1f}/s)", "open_loop", multiple))
    for label, kind, key in phases:
        a, b = closed[kind][key], continuous[kind][key]
        ratio = b["pages_per_s"]["median"] / a["pages_per_s"]["median"]
        requests = sum(run["requests"] for run in a["runs"])
        lost = sum(r["outcomes"]["mismatch"] + r["outcomes"]["error"] for r in (a, b))
        lines.append(f"| {label} | {fmt(a['pages_per_s'])} ({a['pages_per_s']['min']:.2f}–{a['pages_per_s']['max']:.2f}) "
                     f"| {fmt(b['pages_per_s'])} ({b['pages_per_s']['min']:.2f}–{b['pages_per_s']['max']:.2f}) "
                     f"| {ratio:.2f}× | {fmt(a['p50_s'])} / {fmt(a['p99_s'])} | {fmt(b['p50_s'])} / {fmt(b['p99_s'])} "
                     f"| {a['outcomes']['busy']} / {b['outcomes']['busy']} (of ~{requests}) | {lost} |")
    return "\n".join(lines)


def interleaved(names: list[str], repeats: int, run) -> dict[str, list]:
    """``run(name, repeat)`` for every contender and repeat, their order alternating by repeat."""
    runs: dict[str, list] = {name: [] for name in names}
    for repeat in range(repeats):
        for name in (names if repeat % 2 == 0 else names[::-1]):
            runs[name].append(run(name, repeat))
    return runs


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
    parser.add_argument("--table", type=Path, default=None, help="print the docs' table of a results JSON and stop")
    args = parser.parse_args(argv)
    if args.table is not None:
        print(markdown_table(json.loads(args.table.read_text())))
        return 0
    if args.quick:
        args.pages, args.repeats, args.clients, args.duration, args.per_client = 16, 1, "1,16", 8.0, 3
        args.rates = "1,3"

    model = Path(args.model) if args.model else DEFAULT_OUT
    dataset = benchmark_pages(args.pages)
    pages = [encode_image(dataset.load_image(page)) for page in dataset.pages()]
    clients = [int(c) for c in args.clients.split(",")]
    rates = [float(r) for r in args.rates.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    names = ["closed", "continuous"]
    servers, clients_of = {}, {}
    started = time.perf_counter()
    try:
        for name in names:
            service = f"triton-load-{name}-{int(time.time())}"
            servers[name] = start_triton(str(model.resolve()), ports=TritonPorts.free(), name=service,
                                         repository_dir=args.out / f"model_repository-{name}",
                                         request_log_dir=args.out / f"requests-{name}", batching=name,
                                         max_batch_size=args.max_batch_size, max_queue_size=args.max_queue_size)
            clients_of[name] = DocMarkupClient(servers[name].http_url, servers[name].grpc_url, timeout_s=600,
                                               probe_key=servers[name].probe_key)
        references = [a.token_ids for a in (clients_of["continuous"].transcribe(page, max_new_tokens=args.max_new_tokens,
                                                                                probe=True) for page in pages)]
        results: dict[str, dict] = {name: {"closed_loop": {}, "open_loop": {}} for name in names}
        for count in clients:
            runs = interleaved(names, args.repeats, lambda name, _r, count=count: closed_loop(
                clients_of[name], pages, references, count, args.per_client, args.max_new_tokens))
            for name in names:
                results[name]["closed_loop"][str(count)] = aggregate(runs[name])
                print(f"[load] {name}, closed loop, {count} clients: {results[name]['closed_loop'][str(count)]['pages_per_s']} "
                      f"pages/s, p99 {results[name]['closed_loop'][str(count)]['p99_s']} s, "
                      f"outcomes {results[name]['closed_loop'][str(count)]['outcomes']}", flush=True)
        anchor = str(16 if 16 in clients else max(clients))
        sustainable = results["closed"]["closed_loop"][anchor]["pages_per_s"]["median"]
        for multiple in rates:
            runs = interleaved(names, args.repeats, lambda name, seed, multiple=multiple: open_loop(
                clients_of[name], pages, references, multiple * sustainable, args.duration, seed, args.max_new_tokens))
            for name in names:
                opened = results[name]["open_loop"][str(multiple)] = aggregate(runs[name])
                print(f"[load] {name}, open loop at {multiple}x the closed batches' {sustainable:.2f} pages/s: "
                      f"{opened['pages_per_s']} pages/s answered, p99 {opened['p99_s']} s, outcomes {opened['outcomes']}",
                      flush=True)
        runs = interleaved(names, max(3, args.repeats), lambda name, _r: short_behind_long(
            clients_of[name], pages, references, args.max_new_tokens))
        for name in names:
            results[name]["short_behind_long"] = {"ratio": spread(runs[name], "ratio"), "runs": runs[name]}
            print(f"[load] {name}: a short page behind 7 long ones takes {results[name]['short_behind_long']['ratio']}x "
                  f"its time alone", flush=True)
        runs = interleaved(names, args.repeats, lambda name, _r: streamed_first_commit(
            clients_of[name], pages, references, 16, args.max_new_tokens))
        for name in names:
            results[name]["first_commit_16_streams"] = {"p50_s": spread(runs[name], "first_commit_p50_s"),
                                                        "p99_s": spread(runs[name], "first_commit_p99_s"),
                                                        "runs": runs[name]}
            print(f"[load] {name}: first streamed commit at 16 streams p50 "
                  f"{results[name]['first_commit_16_streams']['p50_s']} s", flush=True)
        crashed = {name: 0 if clients_of[name].ready() else 1 for name in names}
    finally:
        for server in servers.values():
            server.stop()
    tokens = [len(r) for r in references]
    result = {"model": str(model), "pages": len(pages),
              "tokens_per_page": {"min": min(tokens), "median": statistics.median(tokens), "max": max(tokens)},
              "max_batch_size": args.max_batch_size, "max_queue_size": args.max_queue_size,
              "sustainable_pages_per_s": sustainable, "contenders": results, "crashed": crashed,
              "seconds": round(time.perf_counter() - started, 1)}
    (args.out / "serving_load.json").write_text(json.dumps(result, indent=2))
    plot(results, args.out / "serving_load.png")
    print(markdown_table(result))
    lost = 0
    for name in names:
        phases = (*results[name]["closed_loop"].values(), *results[name]["open_loop"].values())
        lost += sum(r["outcomes"]["mismatch"] + r["outcomes"]["error"] for r in phases)
        lost += sum(run["outcomes"]["mismatch"] + run["outcomes"]["error"] for run in results[name]["short_behind_long"]["runs"])
    worst = str(max(rates, key=float))
    for name in names:
        opened = results[name]["open_loop"][worst]
        print(f"{name}: {results[name]['closed_loop'][anchor]['pages_per_s']['median']:.2f} pages/s at {anchor} clients, "
              f"p99 {results[name]['closed_loop'][anchor]['p99_s']['median']:.2f} s; at {worst}x: {opened['outcomes']['busy']} "
              f"refused (slowest refusal {opened['slowest_refusal_s']}), p99 of the answered {opened['p99_s']['median']:.2f} s")
    print(f"wrote {args.out / 'serving_load.json'} and serving_load.png ({result['seconds']:.0f} s)")
    throughput = (results["continuous"]["closed_loop"][anchor]["pages_per_s"]["median"]
                  / results["closed"]["closed_loop"][anchor]["pages_per_s"]["median"])
    p99 = results["continuous"]["closed_loop"][anchor]["p99_s"]["median"] / results["closed"]["closed_loop"][anchor]["p99_s"]["median"]
    print(f"continuous/closed at {anchor} clients: throughput {throughput:.2f}x, p99 {p99:.2f}x; lost {lost}; "
          f"crashed {sum(crashed.values())}")
    return 0 if not any(crashed.values()) and lost == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
