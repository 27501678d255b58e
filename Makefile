# Two jobs: `make demo` (the embedded default, two CPU processes) and `make test`. Each creates .venv and
# installs into it. `make demo ARGS="--seed 1"` passes flags on to rl/train_grpo.py.
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

# pip's own output (on this kind of machine, a warning per package for each local index that lacks it) goes to
# $(VENV)/install.log; it is printed only if the install fails
$(VENV)/.installed: pyproject.toml
	@echo "installing refine-rl and its dependencies into $(VENV) (about 3 minutes the first time; log: $(VENV)/install.log)"
	@python3 -m venv $(VENV)
	@{ $(PY) -m pip install --disable-pip-version-check --upgrade pip && \
	   $(PY) -m pip install --disable-pip-version-check -e '.[cpu,dev]'; } > $(VENV)/install.log 2>&1 || \
	 { tail -n 40 $(VENV)/install.log; echo "install failed: the whole log is $(VENV)/install.log"; exit 1; }
	@touch $@
	@echo "installed: $$($(PY) -c 'import torch, trl, transformers; print("torch", torch.__version__, "· trl", trl.__version__, "· transformers", transformers.__version__)')"

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/accelerate launch --config_file configs/accelerate/cpu2.yaml rl/train_grpo.py $(ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest -q --durations=10

.PHONY: install demo test
