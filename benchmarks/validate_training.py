"""The training model against published runs: every validation row's published vs predicted MFU and the
planner's place for the published mesh, with the issue-26 goals; and the two mutants that must fail them.

Rows: data/reference/published/training.csv (``role``: calibration rows fit the one free parameter per GPU,
:func:`labkit.theory.published.fit_sustained`; validation rows never enter the fit). Each published mesh is
priced with the source's own schedule, model chunks, recompute and sharding (validation.yaml).

Goals (issue 26, "Training" and "Planner"), on the validation rows:

* predicted MFU within +-10 % of published on every row; max/min of the ratios <= 1.2;
* the published mesh's predicted step time within 10 % of the planner's top pick's (printed twice: the planner
  free to choose recompute and schedule, and with the source's held);
* no top-5 pick with a TP group across nodes.

Then the mutation check, each mutant refitted on the calibration rows as the real model is: a model with no
communication cost and a constant-efficiency model (every op at one fraction of peak, that fraction fitted) must
each miss the MFU goals. Exit 0 when every goal is met, 1 when one is missed (each printed), 2 for bad input.

    PYTHONPATH=. python benchmarks/validate_training.py [--csv FILE] [--no-mutants]
"""

from __future__ import annotations

import argparse

from labkit.cli import run_main


def _row_line(r) -> str:
    vs = f"{r['step_vs_best']:.2f}x" if r.get("step_vs_best") else "-"
    same = f"{r['step_vs_best_same_settings']:.2f}x" if r.get("step_vs_best_same_settings") else "-"
    ratio = f"{r['ratio']:.3f}" if r.get("ratio") else "-"
    pred = f"{r['predicted_mfu']:.3f}" if r.get("predicted_mfu") else "-"
    return (f"{r['model']:<18} {r['gpus']:>6} {r['role']:<11} {r['published_mfu']:>7.3f} {pred:>7} {ratio:>6} "
            f"{str(r.get('planner_rank')) + '/' + str(r.get('n_ranked')):>8} {vs:>6} {same:>6} "
            f"{r.get('top5_tp_across_nodes')!s:>4}")


def main(argv=None) -> int:
    from labkit.theory import published as pub
    from labkit.theory.mutants import mutant_goals

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", default=None, help="a CSV in training.csv's schema (default: the shipped rows)")
    ap.add_argument("--no-mutants", action="store_true", help="skip the mutation check")
    args = ap.parse_args(argv)
    rows = [r for r in pub.validate_published(path=args.csv) if not r.get("skipped")]
    print("predicted (labkit.theory.planner, kernel model + fitted sustained fraction per GPU) vs published "
          "(training.csv); rank / vs #1: the published configuration among every mesh the planner prices")
    print(f"{'model':<18} {'GPUs':>6} {'role':<11} {'MFU pub':>7} {'pred':>7} {'ratio':>6} {'rank':>8} "
          f"{'vs #1':>6} {'same':>6} {'TPx':>4}")
    for r in rows:
        print(_row_line(r))
    fit = pub.fit_sustained(path=args.csv)
    print(f"fitted sustained fraction per GPU (calibration rows only: {'; '.join(fit['rows'])}): {fit['value']}; "
          f"residuals {fit['residuals']}")
    goals = pub.training_goals(rows)
    missed = 0
    for g in goals:
        print(f"goal {g['goal']}: {'met' if g['met'] else 'NOT met'} ({g['detail']})")
        missed += not g["met"]
    if not args.no_mutants:
        for name, res in mutant_goals(path=args.csv).items():
            ok = not res["passes"]
            print(f"mutant {name} (refit on calibration rows: {res['fit']}): MFU goals "
                  f"{'missed, as they must be' if ok else 'MET: the check cannot tell it from the real model'} "
                  f"({res['detail']})")
            missed += not ok
    print(f"goals missed: {missed}")
    return 0 if missed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(run_main("validate_training", main))
