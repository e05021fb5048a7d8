"""What Kiln's clean costs over the same filters as a plain datatrove pipeline, same input, same run.

Collects the bundled corpus once (the default run's sources), then, `--repeats` times each, in fresh
folders:

- kiln:      `clean_documents`, the clean stage's body: checks the language list and the quality
             model, runs the pipeline through Kiln's executor layer (a task per collected shard),
             each rank writing its kept, removed (with reasons) and quarantined shards as Kiln
             documents and its counts; the stage adds those up and writes the report.
- datatrove: a `LocalPipelineExecutor` over the collected shards: `JsonlReader` (an adapter puts
             source, domain, licence and url in the metadata), then the very filter steps Kiln builds
             (`tasks.data.clean._pipeline`: blocklists, language, Gopher, C4, FineWeb, code rules, the
             quality classifier, PII redaction, each with its domain gate, which tags what it drops),
             then a `JsonlWriter` of everything, counted afterwards. The same filters on the same
             input, as a datatrove user would run them.

The clean settings are the default run's, with the shipped quality model instead of one trained from
references (training is not the clean's filtering). A rank per collected shard, `--workers` at a
time, in both. Both must keep the same number of documents
and remove the same number by each filter. An untimed run of each first imports spaCy and loads
the models; the timed runs then alternate which goes first.

Prints documents/s for each (median seconds) and the ratio; last line
`RESULT clean_overhead_ratio <Kiln seconds / datatrove seconds>`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from datatrove.executor import LocalPipelineExecutor  # noqa: E402
from datatrove.pipeline.readers import JsonlReader  # noqa: E402

from kiln.tasks.data.clean import CleanConfig, _blocklists, _pipeline, clean_documents, lid_model_path  # noqa: E402
from datatrove.pipeline.writers import JsonlWriter  # noqa: E402

from kiln.tasks.data.collect import CollectConfig, collect_documents  # noqa: E402
from kiln.tasks.data.documents import read_shards  # noqa: E402
from kiln.tasks.data.executors import rank_ledger  # noqa: E402
from kiln.tasks.data.quality import check_quality_model  # noqa: E402
from kiln.tasks.data.shards import shard_paths  # noqa: E402


def configs(workers: int) -> tuple[CollectConfig, CleanConfig]:
    """The default run's collect and clean sections (relative paths resolve from the repository)."""
    default = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())
    clean = CleanConfig.model_validate(
        default["clean"] | {"num_workers": workers, "quality_training": None, "quality_top_fraction": None}
    )
    return CollectConfig.model_validate(default["collect"]), clean


def kiln_record(self, data: dict, path: str, id_in_file: int | str) -> dict:
    """A Kiln document as a datatrove one: its fields in the metadata, where the filters read them."""
    metadata = dict(data.get("metadata") or {})
    metadata |= {"source": data["source"], "domain": data["domain"], "licence": data["licence"],
                 "url": metadata.get("url")}
    return {"text": data["text"], "id": data["id"], "metadata": metadata}


def run_kiln(cfg: CleanConfig, corpus: Path, out: Path) -> tuple[int, dict[str, int]]:
    """Documents kept, and removed by each filter."""
    stats = clean_documents(cfg, corpus, out)
    return stats["num_kept"], {label: n for label, n in sorted(stats["removed_by_filter"].items()) if n}


def run_datatrove(cfg: CleanConfig, corpus: Path, out: Path) -> tuple[int, dict[str, int]]:
    quality_model = None if cfg.quality_model is None else check_quality_model(cfg.quality_model)
    shards = shard_paths(corpus)
    # The ledger only feeds Kiln's writer, which the JsonlWriter below replaces.
    ledger = rank_ledger(out / "ranks", "bench_clean", {}, [{"shard": shard} for shard in shards])
    steps = _pipeline(cfg, shards, out, lid_model_path(), quality_model, _blocklists(cfg), ledger)
    steps[0] = JsonlReader(str(corpus / "documents"), glob_pattern="*.jsonl.zst", adapter=kiln_record)
    steps[-1] = JsonlWriter(str(out / "all"), compression=None)
    LocalPipelineExecutor(steps, tasks=len(shards), workers=cfg.num_workers, logging_dir=str(out / "logs")).run()
    kept, removed = 0, {}
    for path in sorted((out / "all").glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            reason = json.loads(line)["metadata"].get("filter_reason")
            if reason is None:
                kept += 1
            else:
                removed[reason.split(":", 1)[0]] = removed.get(reason.split(":", 1)[0], 0) + 1
    return kept, dict(sorted(removed.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Expected duration: a minute or two for the corpus, then about 10-30 s per "
                                            "repeat of each side on 2 cores (2 x --repeats cleans of the sample).")
    parser.add_argument("--repeats", type=int, default=5, help="timed cleans of each side, in fresh folders (default: 5)")
    parser.add_argument("--workers", type=int, default=1, help="datatrove tasks at a time, both sides (default: 1)")
    args = parser.parse_args()

    os.chdir(REPO)  # the configs' relative paths
    from loguru import logger

    logger.remove()  # datatrove logs every step's stats to the terminal; Kiln's clean sends them to its log file
    collect_cfg, clean_cfg = configs(args.workers)
    methods = {"kiln": run_kiln, "datatrove": run_datatrove}
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    outcomes: dict[str, set[str]] = {name: set() for name in methods}
    with tempfile.TemporaryDirectory(prefix="kiln-clean-overhead-") as tmp:
        work = Path(tmp)
        (work / "collect").mkdir()
        collect_documents(collect_cfg, work / "collect")
        corpus = work / "collect"
        docs = list(read_shards(shard_paths(corpus)))
        num_docs, num_bytes = len(docs), sum(len(doc.text.encode()) for doc in docs)
        # Untimed: the first run in a process imports spaCy and loads the models.
        for name, method in methods.items():
            (work / f"warm-up-{name}").mkdir()
            method(clean_cfg, corpus, work / f"warm-up-{name}")
        for repeat in range(args.repeats):
            # Interleaved, and in turn first: both see the same load over time.
            for name, method in sorted(methods.items(), reverse=repeat % 2 == 1):
                out = work / f"{name}-{repeat}"
                out.mkdir()
                started = time.perf_counter()
                outcomes[name].add(json.dumps(method(clean_cfg, corpus, out), sort_keys=True))
                seconds[name].append(time.perf_counter() - started)
                print(f"repeat {repeat}: {name} {seconds[name][-1]:.2f} s", file=sys.stderr, flush=True)
    assert outcomes["kiln"] == outcomes["datatrove"] and len(outcomes["kiln"]) == 1, f"outcomes differ: {outcomes}"
    num_kept, removed = json.loads(outcomes["kiln"].pop())
    median = {name: statistics.median(values) for name, values in seconds.items()}
    print(f"corpus: {num_docs} collected documents, {num_bytes / 1e6:.1f} MB of text; {num_kept} kept by both, "
          f"removed by both {removed}; {args.workers} rank(s); medians of {args.repeats}; {os.cpu_count()} CPUs")
    print(f"{'method':<11}{'seconds':>9}{'docs/s':>9}   all runs")
    for name in methods:
        runs = ", ".join(f"{s:.2f}" for s in seconds[name])
        print(f"{name:<11}{median[name]:>9.2f}{num_docs / median[name]:>9.1f}   {runs}")
    print(f"RESULT clean_overhead_ratio {median['kiln'] / median['datatrove']:.2f}")


if __name__ == "__main__":
    main()
