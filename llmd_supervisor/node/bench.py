"""Stand-in benchmark client: stdlib only, Python 3.9+.

For each request it asks a prefill engine for one token (``kv_transfer_params`` with
``do_remote_decode``), then hands the returned ``kv_transfer_params`` to a decode engine,
which pulls the KV stand-in from that prefill engine -- so one point exercises the
coordinator -> prefill -> decode path across nodes. Engines are picked round-robin.
``--num-prompts`` requests are issued with ``--concurrency`` in flight, paced by
``--request-rate`` (requests/s, ``inf`` for none). The result is written as JSON to
``--result-file``.

Exit codes: 0 all requests succeeded; 1 some request failed; 2 bad arguments;
7 the fault knob ``LLMD_FAKE_BENCH_FAIL_CONCURRENCY`` names this point's concurrency
(comma-separated list allowed); a hang is available with ``LLMD_FAKE_BENCH_HANG=1``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import urllib.request
from typing import Any, Dict, List, Optional

FAULT_RC = 7


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
    return {
        "latency_s": time.monotonic() - start,
        "ttft_s": ttft,
        "output_tokens": int(second.get("usage", {}).get("completion_tokens", 0)),
        "prefill": p,
        "decode": d,
    }


def percentile(values: List[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100.0 * (len(ordered) - 1))))
    return ordered[k]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="stand-in llm-d benchmark client")
    parser.add_argument("--prefill-urls", required=True)
    parser.add_argument("--decode-urls", required=True)
    parser.add_argument("--served-name", required=True)
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--num-prompts", type=int, required=True)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--request-rate", default="inf")
    parser.add_argument("--request-timeout", type=float, default=30.0)
    parser.add_argument("--result-file", required=True)
    args = parser.parse_args(argv)
    prefill = [u for u in args.prefill_urls.split(",") if u]
    decode = [u for u in args.decode_urls.split(",") if u]
    rate = float(args.request_rate)

    fail_at = os.environ.get("LLMD_FAKE_BENCH_FAIL_CONCURRENCY", "")
    if str(args.concurrency) in [c.strip() for c in fail_at.split(",")]:
        print("fault: failing concurrency %d with rc %d" % (args.concurrency, FAULT_RC), flush=True)
        with open(args.result_file, "w") as fh:
            json.dump({"concurrency": args.concurrency, "error": "injected fault"}, fh)
        return FAULT_RC
    if os.environ.get("LLMD_FAKE_BENCH_HANG") == "1":
        print("fault: hanging", flush=True)
        while True:
            time.sleep(3600)

    results: List[Dict[str, Any]] = []
    errors: List[str] = []
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
            try:
                r = one_request(i, prefill, decode, args)
            except Exception as exc:
                with lock:
                    errors.append("request %d: %s" % (i, exc))
                continue
            with lock:
                results.append(r)

    threads = [threading.Thread(target=worker) for _ in range(max(1, args.concurrency))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    duration = time.monotonic() - start
    latencies = [r["latency_s"] for r in results]
    summary = {
        "concurrency": args.concurrency,
        "num_prompts": args.num_prompts,
        "completed": len(results),
        "failed": len(errors),
        "errors": errors[:10],
        "duration_s": round(duration, 4),
        "request_throughput": round(len(results) / duration, 3) if duration > 0 else 0.0,
        "output_tokens": sum(r["output_tokens"] for r in results),
        "mean_latency_ms": round(1000 * sum(latencies) / len(latencies), 3) if latencies else 0.0,
        "p50_latency_ms": round(1000 * percentile(latencies, 50), 3),
        "p99_latency_ms": round(1000 * percentile(latencies, 99), 3),
        "prefill_urls": prefill,
        "decode_urls": decode,
    }
    tmp = args.result_file + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(summary, fh, indent=1, sort_keys=True)
    os.replace(tmp, args.result_file)
    print(json.dumps(summary, sort_keys=True), flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
