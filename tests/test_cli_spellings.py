"""The CLI's vLLM spellings (issue 57): ``aserve bench serve --url URL TRACE`` is ``aserve replay TRACE
--url URL`` and ``aserve serve MODEL`` is ``aserve serve --model MODEL``; the old spellings keep
working, ``replay --url`` with a note. Parsing only: no model, no server, no torch."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aserve.commands import build_parser, main
from aserve.commands.replay import URL_NOTE
from aserve.commands.serve import serve_model

ROOT = Path(__file__).resolve().parents[1]
DISPATCH = {"func", "command", "bench", "url_note", "argv"}  # which command ran, not what it was told
FLAGS = ["--num-requests", "8", "--rate", "2", "--slo", "ttft=1,tpot=200ms", "--json", "out.json", "--seed", "3"]


def _told(ns) -> dict:
    return {k: v for k, v in vars(ns).items() if k not in DISPATCH}


def test_bench_serve_parses_to_what_replay_url_does():
    old = build_parser().parse_args(["replay", "t.jsonl", "--url", "http://127.0.0.1:8000", *FLAGS])
    for new in (["bench", "serve", "--url", "http://127.0.0.1:8000", "t.jsonl", *FLAGS],
                ["bench", "serve", "t.jsonl", "--base-url", "http://127.0.0.1:8000", *FLAGS]):
        ns = build_parser().parse_args(new)
        assert _told(ns) == _told(old)
        assert ns.func is old.func  # one command runs both spellings
        assert (ns.url_note, old.url_note) == (False, True)


def test_bench_serve_needs_a_url(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["bench", "serve", "t.jsonl"])
    assert e.value.code == 2 and "--url" in capsys.readouterr().err


def test_bench_serve_help_says_it_is_replays_parser():
    r = subprocess.run([sys.executable, str(ROOT / "cli.py"), "bench", "serve", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    text = " ".join(r.stdout.split())
    assert r.returncode == 0 and "those of 'aserve replay'" in text and "old spelling" in text, r.stdout


def test_replay_url_prints_the_note_and_bench_serve_does_not():
    """Both refuse --step-log with a URL (before anything loads); only the old spelling adds the note."""
    old = subprocess.run([sys.executable, str(ROOT / "cli.py"), "replay", "t.jsonl", "--url", "http://127.0.0.1:9",
                          "--step-log", "s.jsonl"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert old.returncode == 2, old.stderr
    lines = old.stderr.splitlines()
    assert lines[0] == URL_NOTE and "aserve bench serve" in lines[0]
    assert lines[1].startswith("aserve: error: --compare and --step-log")


def test_bench_serve_and_in_process_replay_print_no_note(capsys):
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", "t.jsonl", "--step-log", "s.jsonl"]) == 2
    err = capsys.readouterr().err
    assert URL_NOTE not in err and "--step-log" in err
    assert main(["replay", "t.jsonl", "--devices", "0"]) == 2  # in-process replay: no note
    err = capsys.readouterr().err
    assert URL_NOTE not in err and "--devices" in err


@pytest.mark.parametrize("model", ["default", "HuggingFaceTB/SmolLM2-135M-Instruct", "/models/x.gguf"])
def test_serve_model_positional_is_the_model_flag(model):
    parse = lambda *argv: serve_model(build_parser().parse_args(["serve", *argv]))  # noqa: E731
    new, old = parse(model, "--port", "0"), parse("--port", "0", "--model", model)
    assert new.model == old.model == model
    assert {**_told(new), "model_tag": None} == {**_told(old), "model_tag": None}
    assert parse(model, "--model", model).model == model  # the same model twice is no conflict
    assert parse().model == "default"


def test_serve_model_given_twice_differently_names_both(capsys):
    assert main(["serve", "a-model", "--model", "b-model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("aserve: error:") and "MODEL 'a-model'" in err and "--model 'b-model'" in err


def test_make_serve_passes_args_to_aserve_serve():
    """``make serve ARGS=...`` still runs ``aserve serve`` (the set-up contract's first command)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}  # run by make test too
    r = subprocess.run(["make", "--no-print-directory", "-n", "serve", "ARGS=some-model --port 0"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1].endswith("bin/aserve serve some-model --port 0"), r.stdout


def test_prefix_caching_flags_are_vllms():
    """``--enable-prefix-caching`` / ``--no-enable-prefix-caching`` (on by default, as vLLM v1), and
    the placement that counts cached prefixes, in every command that builds an engine."""
    for argv, want in (([], True), (["--no-enable-prefix-caching"], False), (["--enable-prefix-caching"], True)):
        for cmd in (["serve", "--port", "0"], ["replay", "t.jsonl"], ["generate", "hi"]):
            assert build_parser().parse_args([*cmd, *argv]).enable_prefix_caching is want, cmd
    ns = build_parser().parse_args(["replay", "t.jsonl", "--no-prefix-aware-placement"])
    assert ns.prefix_aware_placement is False and ns.enable_prefix_caching is True


def test_serve_sizes_steps_unless_a_budget_is_given():
    """``serve`` sizes each step's prompts at its decodes' contexts by default; a given
    ``--max-num-batched-tokens`` means that budget (fixed), as do the other commands;
    ``--step-budget`` says it outright."""
    from aserve.commands.common import step_budget

    parse = lambda *argv: step_budget(build_parser().parse_args(list(argv)))  # noqa: E731
    assert parse("serve", "--port", "0") == "sized"
    assert parse("serve", "--port", "0", "--max-num-batched-tokens", "256") == "fixed"
    assert parse("serve", "--port", "0", "--max-num-batched-tokens", "256", "--step-budget", "sized") == "sized"
    assert parse("replay", "t.jsonl") == "fixed" and parse("generate", "hi") == "fixed"
    assert parse("replay", "t.jsonl", "--step-budget", "sized") == "sized"
