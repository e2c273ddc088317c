"""Stand-in benchmark client: stdlib only, Python 3.9+.

Single-URL mode, like ``vllm bench serve --base-url URL``: with ``--base-url`` every
request goes to ``URL`` + ``--endpoint`` (default ``/v1/completions``) and nowhere else,
streamed (``"stream": true``, ``stream_options.include_usage``) as vLLM's openai backend
does; the P/D split is the server's business (the router and the sidecars). TTFT is the
first streamed token, ITL the gaps between the following ones, and the result has
``base_url`` (``prefill_urls`` and ``decode_urls`` are empty).

P/D mode (``--prefill-urls`` and ``--decode-urls``, the original): for each request it
asks a prefill engine for one token (``kv_transfer_params`` with ``do_remote_decode``),
then hands the returned ``kv_transfer_params`` to a decode engine, which pulls the KV
stand-in from that prefill engine -- so one point exercises the
coordinator -> prefill -> decode path across nodes. Engines are picked round-robin.
``--num-prompts`` requests are issued with ``--concurrency`` (or vLLM's
``--max-concurrency``) in flight, paced by ``--request-rate`` (requests/s, ``inf`` for
none).

The result is what ``vllm bench serve --save-result`` writes (vllm/benchmarks/serve.py;
tests/data/results/): ``date``, ``backend``, ``num_prompts``, ``request_rate``,
``max_concurrency``, ``duration``, ``completed``, ``failed``, ``total_input_tokens``,
``total_output_tokens``, ``request_throughput``, ``output_throughput``,
``total_token_throughput``, and ``mean_/median_/std_/p<P>_{ttft,tpot,itl,e2el}_ms`` for
``--percentile-metrics`` and ``--metric-percentiles`` (default 99), plus the stand-in's own
``concurrency``, ``errors`` (the first 10), ``prefill_urls`` and ``decode_urls``. TTFT is
the prefill call; the decode answer is not streamed, so every request's ITL is its TPOT.
It goes to
``--result-file``, or like vLLM to ``--result-dir``/``--result-filename``
(``--save-result`` is accepted), written to a temp file and renamed.

Exit codes: 0 all requests succeeded; 1 some request failed; 2 bad arguments;
7 the fault knob ``LLMD_FAKE_BENCH_FAIL_CONCURRENCY`` names this point's concurrency
(comma-separated list allowed; the result file then holds only an error).

Fault knobs (environment), each of them leaves the exit status 0, as a real client may:

* ``LLMD_FAKE_BENCH_HANG=1`` -- hang forever instead of running the point.
* ``LLMD_FAKE_BENCH_ZERO_OUTPUT=1`` -- requests "complete" with no output tokens.
* ``LLMD_FAKE_BENCH_FAIL_FRACTION=0.5`` -- that share of the requests fails (spread
  evenly, without being sent); exit status 0 anyway.
* ``LLMD_FAKE_BENCH_NO_RESULT=1`` -- run the point, write no result file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
import urllib.request
from datetime import datetime
from typing import Any, Dict, List, Optional

FAULT_RC = 7
METRICS = ("ttft", "tpot", "itl", "e2el")


def post(url: str, body: Dict[str, Any], timeout: float) -> Dict[str, Any]:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode("utf-8"),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        value = json.loads(resp.read().decode("utf-8"))
    if not isinstance(value, dict):
        raise ValueError("non-object response from %s" % url)
    return value


def one_streamed_request(i: int, args: argparse.Namespace) -> Dict[str, Any]:
    """One request to --base-url, streamed; times from the server-sent events."""
    prompt = " ".join("w%d" % (j % 97) for j in range(args.input_len))
    body: Dict[str, Any] = {
        "model": args.served_name,
        "max_tokens": args.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.endpoint.rstrip("/").endswith("/chat/completions"):
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if args.ignore_eos:
        body["ignore_eos"] = True
    req = urllib.request.Request(
        args.base_url.rstrip("/") + args.endpoint,
        data=json.dumps(body).encode("utf-8"),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    start = time.monotonic()
    stamps: List[float] = []
    usage: Dict[str, Any] = {}
    with urllib.request.urlopen(req, timeout=args.request_timeout) as resp:
        for raw in resp:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if isinstance(event.get("usage"), dict):
                usage = event["usage"]
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                if choice.get("text") or delta.get("content"):
                    stamps.append(time.monotonic())
    if not stamps:
        raise ValueError("no token streamed")
    end = time.monotonic()
    return {
        "latency_s": end - start,
        "ttft_s": stamps[0] - start,
        "itls_s": [stamps[k] - stamps[k - 1] for k in range(1, len(stamps))],
        "input_tokens": int(usage.get("prompt_tokens") or args.input_len),
        "output_tokens": int(usage.get("completion_tokens") or len(stamps)),
        "prefill": None,
        "decode": None,
    }


def one_request(
    i: int, prefill: List[str], decode: List[str], args: argparse.Namespace
) -> Dict[str, Any]:
    p = prefill[i % len(prefill)]
    d = decode[i % len(decode)]
    prompt = " ".join("w%d" % (j % 97) for j in range(args.input_len))
    start = time.monotonic()
    first = post(
        p + "/v1/completions",
        {
            "model": args.served_name,
            "prompt": prompt,
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True},
        },
        args.request_timeout,
    )
    ttft = time.monotonic() - start
    second = post(
        d + "/v1/completions",
        {
            "model": args.served_name,
            "prompt": prompt,
            "max_tokens": args.output_len,
            "kv_transfer_params": first.get("kv_transfer_params") or {},
        },
        args.request_timeout,
    )
    usage = second.get("usage") or {}
    return {
        "latency_s": time.monotonic() - start,
        "ttft_s": ttft,
        "input_tokens": int(usage.get("prompt_tokens") or args.input_len),
        "output_tokens": int(usage.get("completion_tokens") or 0),
        "prefill": p,
        "decode": d,
    }


def percentile(values: List[float], q: float) -> float:
    """numpy.percentile's default (linear interpolation); 0 for no values, as vLLM's
    ``np.percentile(values or 0, q)``."""
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def mean(values: List[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def std(values: List[float]) -> float:  # numpy.std: the population deviation
    if not values:
        return 0.0
    m = mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / len(values))


def fails(i: int, fraction: float) -> bool:
    """Request i is one of the injected failures: floor(n x fraction) of n, spread out."""
    return math.floor((i + 1) * fraction) > math.floor(i * fraction)


def summarize(
    args: argparse.Namespace,
    results: List[Dict[str, Any]],
    errors: List[str],
    duration: float,
    prefill: List[str],
    decode: List[str],
) -> Dict[str, Any]:
    """The vLLM save-result document (key order and types as vllm/benchmarks/serve.py)."""
    total_in = sum(r["input_tokens"] for r in results)
    total_out = sum(r["output_tokens"] for r in results)
    dur = duration if duration > 0 else 1e-9
    ttfts = [r["ttft_s"] for r in results]
    e2els = [r["latency_s"] for r in results]
    tpots: List[float] = []
    itls: List[float] = []
    for r in results:
        if r["output_tokens"] > 1:
            tpot = (r["latency_s"] - r["ttft_s"]) / (r["output_tokens"] - 1)
            tpots.append(tpot)
            itls += r["itls_s"] if "itls_s" in r else [tpot] * (r["output_tokens"] - 1)
    rate = float(args.request_rate)
    doc: Dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": "openai",
        "backend": "openai",
        "label": None,
        "model_id": args.served_name,
        "tokenizer_id": args.served_name,
        "num_prompts": args.num_prompts,
        "request_rate": rate if rate < float("inf") else "inf",
        "burstiness": 1.0,
        "max_concurrency": args.concurrency,
        "duration": duration,
        "completed": len(results),
        "failed": len(errors),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(results) / dur,
        "request_goodput": None,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
    }
    values = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    selected = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    for name in METRICS:
        if name not in selected:
            continue
        v = values[name]
        doc["mean_%s_ms" % name] = mean(v) * 1000
        doc["median_%s_ms" % name] = percentile(v, 50) * 1000
        doc["std_%s_ms" % name] = std(v) * 1000
        for p in [float(x) for x in args.metric_percentiles.split(",") if x.strip()]:
            word = str(int(p)) if int(p) == p else str(p)
            doc["p%s_%s_ms" % (word, name)] = percentile(v, p) * 1000
    doc["concurrency"] = args.concurrency  # the stand-in's own (older) key, kept
    doc["errors"] = errors[:10]
    doc["prefill_urls"] = prefill
    doc["decode_urls"] = decode
    if args.base_url:
        doc["base_url"] = args.base_url
    return doc


def result_path(args: argparse.Namespace) -> Optional[str]:
    if args.result_file:
        return str(args.result_file)
    if args.result_filename:
        return os.path.join(args.result_dir or "", args.result_filename)
    return None


def write_json(path: str, value: Dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(value, fh, indent=1)
    os.replace(tmp, path)


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="stand-in llm-d benchmark client")
    parser.add_argument("--base-url", help="single-URL mode: every request to URL/--endpoint")
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument("--prefill-urls")
    parser.add_argument("--decode-urls")
    parser.add_argument("--served-name", "--model", dest="served_name", required=True)
    parser.add_argument(
        "--concurrency", "--max-concurrency", dest="concurrency", type=int, required=True
    )
    parser.add_argument("--num-prompts", type=int, required=True)
    parser.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=32)
    parser.add_argument(
        "--output-len", "--random-output-len", dest="output_len", type=int, default=16
    )
    parser.add_argument("--request-rate", default="inf")
    parser.add_argument("--request-timeout", type=float, default=30.0)
    parser.add_argument("--result-file")
    parser.add_argument("--save-result", action="store_true")
    parser.add_argument("--result-dir")
    parser.add_argument("--result-filename")
    parser.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    parser.add_argument("--metric-percentiles", default="99")
    # vLLM flags a copied command line may carry; the stand-in has no use for them
    parser.add_argument("--backend", default="openai")
    parser.add_argument("--dataset-name", default="random")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--num-warmups", type=int, default=0)
    args = parser.parse_args(argv)
    if args.base_url and (args.prefill_urls or args.decode_urls):
        parser.error("--base-url (single-URL mode) excludes --prefill-urls/--decode-urls")
    if not args.base_url and not (args.prefill_urls and args.decode_urls):
        parser.error("give --base-url, or both --prefill-urls and --decode-urls")
    if result_path(args) is None:
        parser.error("give --result-file, or --result-filename (with --result-dir)")
    try:
        float(args.request_rate)
        [float(x) for x in args.metric_percentiles.split(",") if x.strip()]
    except ValueError as exc:
        parser.error(str(exc))
    if args.concurrency < 1 or args.num_prompts < 0:
        parser.error("--concurrency must be >= 1 and --num-prompts >= 0")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    path = result_path(args)
    assert path is not None
    prefill = [u for u in (args.prefill_urls or "").split(",") if u]
    decode = [u for u in (args.decode_urls or "").split(",") if u]
    rate = float(args.request_rate)

    fail_at = os.environ.get("LLMD_FAKE_BENCH_FAIL_CONCURRENCY", "")
    if str(args.concurrency) in [c.strip() for c in fail_at.split(",")]:
        print("fault: failing concurrency %d with rc %d" % (args.concurrency, FAULT_RC), flush=True)
        write_json(path, {"max_concurrency": args.concurrency, "error": "injected fault"})
        return FAULT_RC
    if os.environ.get("LLMD_FAKE_BENCH_HANG") == "1":
        print("fault: hanging", flush=True)
        while True:
            time.sleep(3600)
    zero_output = os.environ.get("LLMD_FAKE_BENCH_ZERO_OUTPUT") == "1"
    no_result = os.environ.get("LLMD_FAKE_BENCH_NO_RESULT") == "1"
    try:
        fail_fraction = float(os.environ.get("LLMD_FAKE_BENCH_FAIL_FRACTION") or 0.0)
    except ValueError:
        fail_fraction = 0.0
    fail_fraction = min(1.0, max(0.0, fail_fraction))

    results: List[Dict[str, Any]] = []
    errors: List[str] = []
    injected = [0]
    lock = threading.Lock()
    next_index = [0]
    start = time.monotonic()

    def worker() -> None:
        while True:
            with lock:
                i = next_index[0]
                if i >= args.num_prompts:
                    return
                next_index[0] += 1
            if rate != float("inf") and rate > 0:
                due = start + i / rate
                delay = due - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            if fail_fraction > 0 and fails(i, fail_fraction):
                with lock:
                    injected[0] += 1
                    errors.append("request %d: injected failure" % i)
                continue
            try:
                if args.base_url:
                    r = one_streamed_request(i, args)
                else:
                    r = one_request(i, prefill, decode, args)
            except Exception as exc:
                with lock:
                    errors.append("request %d: %s" % (i, exc))
                continue
            if zero_output:
                r["output_tokens"] = 0
            with lock:
                results.append(r)

    threads = [threading.Thread(target=worker) for _ in range(max(1, args.concurrency))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    duration = time.monotonic() - start
    summary = summarize(args, results, errors, duration, prefill, decode)
    if no_result:
        print("fault: writing no result file", flush=True)
    else:
        write_json(path, summary)
    print(json.dumps(summary, sort_keys=True), flush=True)
    if fail_fraction > 0 and len(errors) == injected[0]:
        return 0  # only the injected failures: a client that exits 0 regardless
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
