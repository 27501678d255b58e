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
	$(PY) -m retrieval.toyworld --config configs/retrieval/toyworld.yaml
	$(PY) -m retrieval.evaluate --config configs/retrieval/evaluate_toy.yaml --alpha_sweep 0:1:0.1

test: $(VENV)/.installed
	$(PY) -m pytest -q

.PHONY: install demo test
