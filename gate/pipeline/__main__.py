"""``python -m gate.pipeline`` (and ``accelerate launch -m gate.pipeline``): the pipeline's entry point,
gate.pipeline.run."""

from common.cli import run
from gate.pipeline.run import main

run(main)
