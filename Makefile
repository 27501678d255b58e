# Two jobs: `make demo` (the embedded default) and `make test`. Each creates .venv and installs into it.
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[cpu,dev]'
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/accelerate launch rl/train_grpo.py

test: $(VENV)/.installed
	$(PY) -m pytest -q

.PHONY: install demo test
