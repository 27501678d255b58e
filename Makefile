# Two jobs: `make demo` (the embedded default, two CPU processes) and `make test`. Each creates .venv and
# installs into it. `make demo ARGS="--seed 1"` passes flags on to rl/train_grpo.py.
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check -e '.[cpu,dev]'
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/accelerate launch --config_file configs/accelerate/cpu2.yaml rl/train_grpo.py $(ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest -q

.PHONY: install demo test
