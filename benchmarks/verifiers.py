"""Throughput of the verifier pool: samples/s for `gsm8k`, `math` and `python_tests`.

    python benchmarks/verifiers.py --workers 2 --samples 1024

Scores N synthetic completions (half right, half wrong) once to start the workers and
import the verifiers, then times `repeats` more batches on the warm pool, as a trainer
sees it every step. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time

from jaxrl_llm.verifiers import VerifierPool, isolation


def gsm8k_batch(n: int, rng: random.Random):
    completions, examples = [], []
    for _ in range(n):
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        answer = a * b if rng.random() < 0.5 else a * b + 1
        steps = " ".join(f"Step {k}: we compute {a} times {b} carefully." for k in range(8))
        completions.append(f"{steps}\nSo the product is {answer:,}.\n#### {answer:,}")
        examples.append({"answer": f"{a} * {b} = <<{a}*{b}={a * b}>>{a * b}\n#### {a * b}"})
    return completions, examples


def math_batch(n: int, rng: random.Random):
    completions, examples = [], []
    for _ in range(n):
        p, q = rng.randint(1, 9), rng.randint(2, 9)
        shown = (
            f"\\frac{{{2 * p}}}{{{2 * q}}}" if rng.random() < 0.5 else f"\\frac{{{p + 1}}}{{{q}}}"
        )
        completions.append(f"Simplifying the ratio gives $\\boxed{{{shown}}}$.")
        examples.append({"answer": f"\\frac{{{p}}}{{{q}}}"})
    return completions, examples


def python_batch(n: int, rng: random.Random):
    completions, examples = [], []
    for _ in range(n):
        k = rng.randint(2, 9)
        body = f"return x * {k}" if rng.random() < 0.5 else f"return x + {k}"
        completions.append(f"Here it is:\n```python\ndef scale(x):\n    {body}\n```")
        examples.append({"tests": [f"assert scale({i}) == {i * k}" for i in (1, 2, 3)]})
    return completions, examples


def measure(pool, specs, batch, repeats: int) -> tuple[float, float, int]:
    """(cold samples/s, warm samples/s median, errors+timeouts) for one verifier."""
    completions, examples = batch
    start = time.perf_counter()
    pool.score(specs, completions, examples)
    cold = len(completions) / (time.perf_counter() - start)
    rates, failures = [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        _, details = pool.score(specs, completions, examples)
        rates.append(len(completions) / (time.perf_counter() - start))
        failures += sum(details.errors.values()) + sum(details.timeouts.values())
    return cold, statistics.median(rates), failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(0)
    cases = [
        ("gsm8k", [("gsm8k", 1.0)], gsm8k_batch(args.samples, rng)),
        ("math", [("math", 1.0)], math_batch(args.samples, rng)),
        ("python_tests", [("python_tests", 1.0)], python_batch(args.samples, rng)),
    ]
    print(
        f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
        f"workers={args.workers}, N={args.samples}; sandbox isolation: {isolation()}"
    )
    print("| verifier | cold samples/s | warm samples/s | errors+timeouts |")
    print("|---|---:|---:|---:|")
    with VerifierPool(workers=args.workers, timeout_s=10.0) as pool:
        for name, specs, batch in cases:
            cold, warm, failures = measure(pool, specs, batch, args.repeats)
            print(f"| {name} | {cold:,.0f} | {warm:,.0f} | {failures} |")


if __name__ == "__main__":
    main()
