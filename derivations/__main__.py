"""``python -m derivations [--json [PATH]] [--verbose] [--only NAME ...]``

Runs every derivation check, prints one row per identity (identity, method, sizes, result, negative
control rejected?) and exits 1 if any check fails or any negative control is accepted. While it runs, a
line per check goes to stderr as soon as that check has finished.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import time

from . import MODULES, all_good, as_rows, run_module


def table(results, verbose: bool) -> str:
    out = []
    for k, (r, seconds) in enumerate(results, 1):
        verdict = "pass" if r.passed else "FAIL"
        control = "rejected" if r.negative_control_rejected else "ACCEPTED"
        out.append(f"{k:>2}. {r.identity}")
        out.append(f"    result: {verdict:<5} negative control: {control:<9} ({seconds:.1f} s)")
        for label, text in (("method", r.method), ("sizes", r.sizes), ("control", r.negative_control)):
            out.append(textwrap.fill(text, width=100, initial_indent=f"    {label + ':':<9}",
                                     subsequent_indent=" " * 13))
        if verbose or not (r.passed and r.negative_control_rejected):
            out.extend(f"      {line}" for line in r.details)
    return "\n".join(out)


def progress(k: int, total: int, r, seconds: float) -> str:
    """The line printed as soon as check `k` of `total` has finished."""
    verdict = "pass" if r.passed else "FAIL"
    control = "rejected" if r.negative_control_rejected else "ACCEPTED"
    return f"[{k:>2}/{total}] {verdict:<4} control {control:<8} {seconds:5.1f} s  {r.identity}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m derivations", description=__doc__.splitlines()[2])
    parser.add_argument("--json", nargs="?", const="-", metavar="PATH",
                        help="also write the rows as JSON to PATH (or to stdout with no PATH)")
    parser.add_argument("--verbose", "-v", action="store_true", help="print every claim and control")
    parser.add_argument("--only", nargs="+", choices=MODULES, metavar="NAME",
                        help=f"run only these modules ({', '.join(MODULES)})")
    args = parser.parse_args(argv)

    names = args.only or MODULES
    start = time.perf_counter()
    results = []
    for k, name in enumerate(names, 1):
        results.append(run_module(name))
        print(progress(k, len(names), *results[-1]), file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - start
    ok = all_good(results)
    payload = {"all_passed": ok, "rows": as_rows(results)}

    if args.json == "-":
        json.dump(payload, sys.stdout, indent=2, ensure_ascii=False)
        print()
    else:
        print(table(results, args.verbose))
        n_pass = sum(r.passed for r, _ in results)
        n_rej = sum(r.negative_control_rejected for r, _ in results)
        print(f"\n{n_pass}/{len(results)} identities pass, {n_rej}/{len(results)} negative controls rejected "
              f"({elapsed:.1f} s): {'OK' if ok else 'FAILED'}")
        if args.json:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump(payload, fh, indent=2, ensure_ascii=False)
                fh.write("\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
