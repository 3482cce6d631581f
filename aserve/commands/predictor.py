"""``aserve predictor train|eval|trace|agree`` and ``aserve label``: the length predictors' commands.

    aserve label --out predictors/data/labels_smollm2.jsonl [--limit N --max-tokens 1024 ...]
    aserve predictor train --backend sklearn --granularity 200 [--labels F --prompts F --out DIR]
    aserve predictor prepare [--backends sklearn,lm,retrieval --granularities 100,200,400]  (what serve would fit)
    aserve predictor eval --backend retrieval --json out.json [--prompts F --labels F]
    aserve predictor trace --out /tmp/heldout.jsonl [--num-requests 128 --rate 1.0]
    aserve predictor agree LABELS_A LABELS_B [--json agree.json]   (two label runs of the same prompts)
    aserve predictor ceiling LABELS [--granularity 100,200,400 --backends sklearn,lm --targets samples]
    aserve predictor share --out DIR [--seeds 0,1,2 ...]   (each backend's share of the oracle's gain)

Bad input raises ValueError / FileNotFoundError naming the field; ``aserve.commands.main`` turns
those into one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from aserve.commands.common import add_engine_args, engine_config, parse_options
from aserve.commands.predictor_share import add_share_parser
from predictors.base import GRANULARITIES
from predictors.dataset import DEFAULT_LABELS, DEFAULT_PROMPTS, SPLITS
from predictors.samples import TARGETS
from predictors.train import SERVING_BACKENDS


def register(subparsers) -> None:
    """Register ``predictor train|prepare|eval|trace|agree`` and ``label``."""
    from predictors.registry import BACKENDS

    p = subparsers.add_parser("predictor", help="train and evaluate output-length predictors")
    psub = p.add_subparsers(dest="predictor_command", required=True)
    t = psub.add_parser("train", help="fit a backend on the train split of a label file and save it")
    _data_args(t, BACKENDS)
    t.add_argument("--granularity", type=int, default=200, help="bucket width in tokens (paper: 100, 200, 400)")
    t.add_argument("--out", default=None, help="artefact folder (default: under ~/.cache/aserve/predictors/)")
    t.add_argument("--all", dest="use_all", action="store_true", help="train on every label, test split included")
    t.add_argument("--targets", default="median", choices=TARGETS,
                   help="sampled labels: median (a row a prompt) | samples (a row a sample) | mode (the modal bucket)")
    t.set_defaults(func=cmd_train)
    pr = psub.add_parser("prepare", help="train ahead every artefact a server would fit on first use "
                                         "(what 'make predictors' runs); those already there are kept")
    pr.add_argument("--backends", default=",".join(SERVING_BACKENDS), help="comma-separated")
    pr.add_argument("--granularities", default=",".join(map(str, GRANULARITIES)), help="comma-separated")
    pr.add_argument("--labels", default=str(DEFAULT_LABELS), help="labels JSONL from 'aserve label'")
    pr.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="prompts JSONL the labels refer to")
    pr.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="backend option, as --predictor-option will pass it to the server (repeatable)")
    pr.set_defaults(func=cmd_prepare)
    e = psub.add_parser("eval", help="score a backend on the test split at several granularities")
    _data_args(e, BACKENDS)
    e.add_argument("--json", required=True, help="write the report here")
    e.add_argument("--granularities", default=",".join(map(str, GRANULARITIES)), help="comma-separated")
    e.add_argument("--model-dir", default=None, help="load/save artefacts as DIR/g<granularity> (default: cache)")
    e.add_argument("--retrain", action="store_true", help="fit again even when a trained artefact exists")
    e.add_argument("--threads", type=int, default=1, help="torch threads while measuring (server: 1, parallel mode)")
    e.add_argument("--latency-samples", type=int, default=200, help="single predictions timed for p50/p99")
    e.add_argument("--prefill-overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the served model's 512-token prefill alone and beside the predictor "
                        "(loads the model; --no-prefill-overlap skips it)")
    e.set_defaults(func=cmd_eval)
    tr = psub.add_parser("trace", help="write a replay trace of held-out prompts whose output lengths are their labels")
    tr.add_argument("--labels", default=str(DEFAULT_LABELS), help="labels JSONL from 'aserve label'")
    tr.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="prompts JSONL the labels refer to")
    tr.add_argument("--out", required=True, help="trace JSONL to write (it holds prompt text: keep it out of git)")
    tr.add_argument("--num-requests", type=int, default=128)
    tr.add_argument("--rate", type=float, default=1.0, help="mean arrivals per second (Gamma gaps)")
    tr.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape: 1 = Poisson, < 1 = burstier")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--length", default="sample", choices=("sample", "median"),
                    help="sampled labels: each request's output is one of its samples (drawn by --seed) "
                         "or their median")
    tr.add_argument("--all", dest="use_all", action="store_true", help="draw from every label, not only the test split")
    tr.set_defaults(func=cmd_trace)
    c = psub.add_parser("ceiling", help="the prompt-only ceiling of sampled labels, and each backend as a share of it")
    c.add_argument("labels", help="labels JSONL with several samples a prompt "
                                  "(aserve label --samples K --temperature T)")
    c.add_argument("--granularity", default=",".join(map(str, GRANULARITIES)), help="comma-separated")
    c.add_argument("--backends", default="", help="comma-separated backends to fit on the train split and score")
    c.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="prompts JSONL the labels refer to (for --backends)")
    c.add_argument("--targets", default="samples", choices=TARGETS, help="how the backends train on the samples")
    c.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="backend option (repeatable)")
    c.add_argument("--retrain", action="store_true", help="fit again even when a trained artefact exists")
    c.add_argument("--json", default=None, help="also write the report here")
    c.set_defaults(func=cmd_ceiling)
    ag = psub.add_parser("agree", help="how often two label runs of the same prompts land in the same bucket")
    ag.add_argument("labels_a", help="labels JSONL (e.g. the committed labels)")
    ag.add_argument("labels_b", help="labels JSONL of another run over some of the same prompts")
    ag.add_argument("--granularities", default=",".join(map(str, GRANULARITIES)), help="comma-separated")
    ag.add_argument("--json", default=None, help="also write the report here")
    ag.set_defaults(func=cmd_agree)
    add_share_parser(psub)
    _add_label_command(subparsers)


def _add_label_command(subparsers) -> None:
    lab = subparsers.add_parser("label", help="record the served model's output lengths for the prompt pool")
    lab.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="prompts JSONL (id, source, prompt)")
    lab.add_argument("--out", default=str(DEFAULT_LABELS), help="labels JSONL; appended to, resumed")
    lab.add_argument("--limit", type=int, default=None, help="label the first N prompts of the stable order")
    lab.add_argument("--split", choices=SPLITS, default="all",
                     help="label only the predictors' train or test split of the pool (by prompt id)")
    lab.add_argument("--max-tokens", type=int, default=1024)
    lab.add_argument("--temperature", type=float, default=0.0)
    lab.add_argument("--top-p", type=float, default=1.0)
    lab.add_argument("--samples", type=int, default=1, help="outputs per prompt (needs --temperature > 0)")
    lab.add_argument("--batch-size", type=int, default=256, help="prompts per engine call (and per file flush)")
    add_engine_args(lab)
    lab.set_defaults(func=cmd_label)


def _data_args(p: argparse.ArgumentParser, backends) -> None:
    p.add_argument("--backend", required=True, choices=list(backends))
    p.add_argument("--labels", default=str(DEFAULT_LABELS), help="labels JSONL from 'aserve label'")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="prompts JSONL the labels refer to")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="backend option, e.g. --option num_layers=8 (repeatable; JSON values)")


def _granularities(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"field 'granularities': expected integers like 100,200,400, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"field 'granularities': need integers >= 1, got {text!r}")
    return values


def cmd_train(a: argparse.Namespace) -> int:
    from predictors.train import TrainConfig, train_predictor

    cfg = TrainConfig(a.backend, a.granularity, Path(a.labels), Path(a.prompts), Path(a.out) if a.out else None,
                      use_all=a.use_all, options=parse_options(a.option), targets=a.targets)
    _, _, summary = train_predictor(cfg)
    print(json.dumps(summary, indent=1))
    return 0


def cmd_prepare(a: argparse.Namespace) -> int:
    from predictors.registry import BACKENDS
    from predictors.train import prepare

    backends = [b.strip() for b in a.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if not backends or unknown:
        raise ValueError(f"field 'backends': unknown {unknown or a.backends!r}; valid: {', '.join(SERVING_BACKENDS)}")
    rows = prepare(backends, _granularities(a.granularities), a.labels, a.prompts, parse_options(a.option))
    print(json.dumps(rows, indent=1))
    return 0


def cmd_eval(a: argparse.Namespace) -> int:
    from aserve.predict.overlap import prefill_slowdown
    from aserve.replay.report import write_json
    from predictors.evaluate import evaluate_backend

    report = evaluate_backend(a.backend, a.prompts, a.labels, _granularities(a.granularities),
                              Path(a.model_dir) if a.model_dir else None, a.retrain, parse_options(a.option),
                              threads=a.threads, latency_samples=a.latency_samples,
                              prefill_overlap=prefill_slowdown if a.prefill_overlap else None)
    write_json(report, a.json)
    _print_table(report)
    return 0


def cmd_trace(a: argparse.Namespace) -> int:
    """A replay trace in which the true output length of every prompt is known: the held-out
    prompts (never trained on) with their labelled greedy lengths as the output to generate,
    so ``aserve replay --predictor B`` can be set beside ``--predictor oracle`` on equal terms."""
    import random

    from aserve.replay.traces import gamma_arrivals
    from predictors.dataset import load_examples, split_by_id
    from predictors.samples import pick_length

    if a.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {a.num_requests}")
    if a.rate <= 0 or a.burstiness <= 0:
        raise ValueError(f"--rate and --burstiness must be > 0, got {a.rate}, {a.burstiness}")
    examples = load_examples(a.prompts, a.labels)
    pool = examples if a.use_all else split_by_id(examples)[1]
    pool = [e for e in pool if min(e.lengths) >= 1]  # a request generates at least one token
    if len(pool) < a.num_requests:
        raise ValueError(f"--num-requests {a.num_requests}: only {len(pool)} labelled prompts in "
                         f"{'the label file' if a.use_all else 'its test split'}")
    picked = random.Random(a.seed).sample(pool, a.num_requests)
    lengths = [pick_length(e, a.length, a.seed) for e in picked]
    times = gamma_arrivals(len(picked), a.rate, a.burstiness, a.seed)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for t, e, n in zip(times, picked, lengths):
            f.write(json.dumps({"timestamp": round(t, 6), "prompt": e.prompt, "output_tokens": n, "id": e.id}) + "\n")
    print(f"wrote {out}: {len(picked)} held-out prompts, mean output {sum(lengths) / len(lengths):.0f} "
          f"tokens ({a.length} of each prompt's labelled lengths), {a.rate} req/s")
    return 0


def cmd_ceiling(a: argparse.Namespace) -> int:
    from aserve.replay.report import write_json
    from predictors.ceiling import ceiling_report

    backends = [b.strip() for b in a.backends.split(",") if b.strip()]
    report = ceiling_report(a.labels, _granularities(a.granularity), backends, a.prompts, a.targets,
                            parse_options(a.option), a.retrain)
    if a.json:
        write_json(report, a.json)
    _print_ceiling(report, backends)
    return 0


def _print_ceiling(report: dict, backends: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    spp = report["samples_per_prompt"]
    table = Table(title=f"prompt-only ceiling of {report['labels']} ({spp['min']}-{spp['max']} samples a prompt, "
                        f"cap {report['cap']}); backends on a fresh sample of held-out prompts (targets: "
                        f"{report['targets']}), as a share of the ceiling on the same prompts")
    for col in ["g", "ceiling (all)", "prompts", "ceiling (test)", "majority"] + backends:
        table.add_column(col, justify="right")

    def pct(v: Optional[float]) -> str:
        return "n/a" if v is None else f"{v:.1%}"

    def cell(r: Optional[dict]) -> str:  # accuracy on a fresh sample (its share of the ceiling)
        if not r or r.get("of_ceiling") is None:
            return "n/a"
        return f"{r['fresh_sample_accuracy']:.1%} ({r['of_ceiling']:.0%})"

    for g, r in report["granularities"].items():
        table.add_row(g, pct(r["ceiling"]), str(r["n"]), pct(r["test"]["ceiling"]), cell(r.get("majority")),
                      *[cell(r["backends"][b]) for b in backends])
    Console(file=sys.stderr).print(table)
    print(json.dumps({g: {"ceiling": r["ceiling"], **{b: r["backends"][b]["of_ceiling"] for b in backends}}
                      for g, r in report["granularities"].items()}))


def cmd_agree(a: argparse.Namespace) -> int:
    from aserve.replay.report import write_json
    from predictors.agreement import label_agreement
    from predictors.dataset import read_labels, require_file

    require_file("labels_a", a.labels_a)
    require_file("labels_b", a.labels_b)
    report = {"labels_a": str(a.labels_a), "labels_b": str(a.labels_b),
              **label_agreement(read_labels(a.labels_a), read_labels(a.labels_b), _granularities(a.granularities))}
    if a.json:
        write_json(report, a.json)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{report['n']} prompts in both runs (cut at {report['cap']} tokens): "
                        f"{report['identical_length']:.1%} identical lengths, mean |difference| "
                        f"{report['mae_tokens']:.0f} tokens")
    for col in ("g", "buckets", "same bucket", "±1 bucket"):
        table.add_column(col, justify="right")
    for g, r in report["granularities"].items():
        table.add_row(g, str(r["num_buckets"]), f"{r['same_bucket']:.1%}", f"{r['within_one_bucket']:.1%}")
    Console(file=sys.stderr).print(table)
    cap = report["at_cap"]
    print(f"at the cap: {cap['a']:.1%} of run A, {cap['b']:.1%} of run B, {cap['both']:.1%} in both")
    return 0


def _print_table(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"length predictor '{report['backend']}' on {report['n_test']} test prompts")
    for col in ("g", "accuracy", "majority", "±1 bucket", "MAE tok", "p50 ms", "p99 ms", "MB"):
        table.add_column(col, justify="right")
    for g, r in report["granularities"].items():
        table.add_row(g, f"{r['accuracy']:.1%}", f"{r['majority_accuracy']:.1%}", f"{r['within_one_bucket']:.1%}",
                      f"{r['mae_tokens']:.0f}", f"{r['latency_ms_p50']:.2f}", f"{r['latency_ms_p99']:.2f}",
                      f"{r['memory_mb']:.1f}")
    Console(file=sys.stderr).print(table)
    if report.get("prefill_overlap"):
        from aserve.predict.overlap import format_overlap

        Console(file=sys.stderr).print(format_overlap(report["prefill_overlap"]), highlight=False)


def cmd_label(a: argparse.Namespace) -> int:
    from aserve.predict.label import label_prompts

    summary = label_prompts(a.prompts, a.out, engine_config(a, derive=False), temperature=a.temperature, top_p=a.top_p,
                            samples=a.samples, batch_size=a.batch_size, limit=a.limit, max_tokens=a.max_tokens,
                            split=a.split)
    print(json.dumps(summary))
    return 0
