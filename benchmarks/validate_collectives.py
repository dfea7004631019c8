"""The collectives model against published nccl-tests rows it was not fitted on.

Prints every ``role == validation`` row of data/reference/published/collectives.csv that is not excluded:
the published busbw (or small-message time), the model's (``predicted (labkit.theory.nccl)``, the number the
emulator charges for that call on the row's profile: ``emulated (<profile>)`` is the same arithmetic), their
ratio, the algorithm/protocol the model picked, and pass/fail against the issue's goal: busbw within +-10 %
from 1 MiB up (and for peaks), small-message latency within +-30 %. Then the excluded rows with their reason,
the same check for two mutants (every link at line rate: the old model; one constant efficiency) and a
summary. Exit status 0 when every row passes, 1 when a goal is missed.

    PYTHONPATH=. python benchmarks/validate_collectives.py [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

from labkit.theory import nccl


def _fmt(x: float) -> str:
    return f"{x:9.3g}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = ap.parse_args(argv)
    prm = nccl.params()
    rows = nccl.validation_table(prm=prm)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0 if all(r["passed"] for r in rows) else 1
    print(f"model: {prm.source}")
    print(f"fitted: {', '.join(f'{k}={v:.3g}' for k, v in prm.as_vector().items())}\n")
    head = (f"{'source':<18} {'op':<14} {'n':>4} {'nodes':>5} {'bytes':>12} {'metric':<6} {'published':>9} "
            f"{'model':>9} {'ratio':>6} {'tol':>5}  {'result':<6} algorithm/protocol (profile)")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['source']:<18} {r['op']:<14} {r['world_size']:>4} {r['nodes']:>5} {r['bytes']:>12} "
              f"{r['metric']:<6} {_fmt(r['published'])} {_fmt(r['predicted'])} {r['ratio']:6.3f} "
              f"{r['tolerance']:5.0%}  {'pass' if r['passed'] else 'FAIL':<6} {r['algorithm']}/{r['protocol']} "
              f"({r['profile']})")
    print("\nexcluded rows (kept in the CSV, never compared):")
    for r in nccl.load_rows():
        if str(r.get("excluded") or "").strip():
            print(f"  {r['source']} {r['op']} bytes={r['bytes'] or 'peak'} value={r['value']}: {r['excluded']}")
    n_pass = sum(r["passed"] for r in rows)
    print(f"\nfitted model: {n_pass}/{len(rows)} validation rows within tolerance")
    for name, m in (("line rate (the old model)", nccl.line_rate_params()),
                    ("constant efficiency 0.8", nccl.constant_efficiency_params())):
        t = nccl.validation_table(prm=m)
        print(f"mutant {name}: {sum(r['passed'] for r in t)}/{len(t)} within tolerance")
    for regime in ("bandwidth", "latency"):
        sub = [r for r in rows if r["regime"] == regime]
        print(f"  {regime}: {sum(r['passed'] for r in sub)}/{len(sub)}")
    ok = n_pass == len(rows)
    print("goal met" if ok else "goal missed: see the FAIL rows above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
