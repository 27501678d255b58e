# Two jobs: `make demo` (the embedded default, two CPU processes) and `make test`. Each creates .venv and
# installs into it. `make demo ARGS="--seed 1 --output_dir outputs/demo-seed1"` passes flags on to rl/train_grpo.py.
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

# On a machine without a GPU, DeepSpeed's CPU accelerator JIT-compiles a shared-memory comm op (for inference
# all-reduce; training does not use it) the first time a DeepSpeed job starts in a new venv: ~45 s of g++ on this kind
# of machine, paid by whichever job comes first. The install builds it once into torch's extension cache instead.
export PREBUILD_DEEPSPEED_CPU_OP := from deepspeed.accelerator import get_accelerator as a; \
b = a().create_op_builder("ShareMemCommBuilder"); a().device_name() != "cpu" or b is None or b.load()

# pip's own output (on this kind of machine, a warning per package for each local index that lacks it) goes to
# $(VENV)/install.log; it is printed only if the install fails
$(VENV)/.installed: pyproject.toml
	@echo "installing refine-rl and its dependencies into $(VENV) (about 3 minutes the first time; log: $(VENV)/install.log)"
	@python3 -m venv $(VENV)
	@{ $(PY) -m pip install --disable-pip-version-check --upgrade pip && \
	   $(PY) -m pip install --disable-pip-version-check -e '.[cpu,dev]'; } > $(VENV)/install.log 2>&1 || \
	 { tail -n 40 $(VENV)/install.log; echo "install failed: the whole log is $(VENV)/install.log"; exit 1; }
	@$(PY) -c "$$PREBUILD_DEEPSPEED_CPU_OP" >> $(VENV)/install.log 2>&1 || \
	 echo "note: DeepSpeed's CPU comm op did not build now (see $(VENV)/install.log); DeepSpeed builds it at first use"
	@touch $@
	@echo "installed: $$($(PY) -c 'import torch, trl, transformers; print("torch", torch.__version__, "· trl", trl.__version__, "· transformers", transformers.__version__)')"

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/accelerate launch --config_file configs/accelerate/cpu2.yaml rl/train_grpo.py $(ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest -q --durations=10

.PHONY: install demo test
