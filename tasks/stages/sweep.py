"""Stage `sweep`: the proxy runs (IsoFLOP grid, LR x batch grid, mixture design), each trial a sub-run.

Each trial is a sub-run (`trials/<name>/`, its own manifest and MLflow child run), trained where
`cluster.launcher` says: `sweep.max_parallel` processes of this stage (`local`), or as many jobs at
a time through torchrun, Slurm or Kubernetes (`tasks.scaling.trial_runs`). Resumable: a retried
attempt reuses every committed trial and resumes the others from their folders. A diverged trial
is committed as such (its child run marked failed, with the reason); a failed one is retried on its
own and, if it keeps failing, recorded uncommitted; the stage fails only when no trial finished.
"""

from __future__ import annotations

from kiln.tasks.constants import SHARDS_FILE
from kiln.tasks.scaling.sweep import SweepConfig, run_sweep, succeeded
from kiln.tasks.scaling.trial_runs import JOBS_DIR, JobTrials, PoolTrials
from kiln.tasks.stage import Stage, StageContext


def run(ctx: StageContext) -> dict:

    cfg, cluster = ctx.cfg.sweep, ctx.cfg.cluster
    if cluster.launcher == "local":
        where = PoolTrials(cfg.max_parallel, cluster.max_restarts)
    else:
        where = JobTrials(cluster.launcher, cluster, cfg.max_parallel, ctx.out_dir / JOBS_DIR,
                          committed_dir=ctx.committed_dir / JOBS_DIR, on_submit=ctx.recorder.job_submitted,
                          earlier_jobs=ctx.recorder.earlier_jobs)
    results = run_sweep(cfg, ctx.read_json("tokenize", SHARDS_FILE), ctx.inputs["tokenize"], ctx.subruns(),
                        where=where, mixture_folds=ctx.cfg.fit.mixture_folds, committed_as=ctx.committed_dir)
    finished = succeeded(results)
    best = min(finished, key=lambda r: r.val_loss)
    return {"num_trials": len(results), "num_ok": len(finished), "launcher": cluster.launcher,
            "num_by_kind": {k: sum(r.kind == k for r in results) for k in ("isoflop", "hyper", "mixture")},
            "num_diverged": sum(r.status == "diverged" for r in results),
            "num_failed": sum(r.status == "failed" for r in results),
            "best_trial": best.name, "best_val_loss": best.val_loss,
            "trial_val_loss": {r.name: r.val_loss for r in finished},
            "excluded_trials": {r.name: f"{r.status} at step {r.steps}: {r.reason}" for r in results if not r.ok}}


def headline(stats: dict) -> dict:
    out = {"trials": stats["num_trials"], "best": stats["best_trial"],
           "best_val_loss": round(stats["best_val_loss"], 4)}
    if stats["num_ok"] < stats["num_trials"]:
        out["not_finished"] = stats["num_trials"] - stats["num_ok"]
    return out


STAGE = Stage(
    name="sweep", description="proxy runs: IsoFLOP grid, LR x batch grid, mixture design", body=run,
    inputs=("tokenize",), reads=("fit.mixture_folds",),
    # 2: the key no longer hashes the unused sweep.optim.lr; 3: failed trials are results (status,
    # reason, steps, curve), trials are named with their batch size, one result file per trial;
    # 4: IsoFLOP, LR x batch and Dirichlet mixture designs; 5: each trial a sub-run (trials/<name>/ with
    # its manifest and result.json); the mixture design grows to the regression's minimum
    config=SweepConfig, version=5, resumable=True, headline=headline,
)
