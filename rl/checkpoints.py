"""Loading a checkpoint's weights back into a full fine-tune outside DeepSpeed and PEFT (resume, best model at end).

transformers 5.24's Trainer saves a checkpoint with ``save_pretrained``, which writes the checkpoint format's key
names (``save_original_format=True``: Qwen2.5-VL's ``visual.*`` and ``model.layers.*``), and reads it back with a raw
``model.load_state_dict(state_dict, False)`` (``Trainer._load_from_checkpoint`` and ``_load_best_model``;
``load_sharded_checkpoint`` for shards), where the model's own names are ``model.visual.*`` and
``model.language_model.*``. No key matches, a warning lists them, and every weight stays as it was
(huggingface/transformers issues 43701 and 40187, open): a resumed run went on from the weights it started from with
the checkpoint's optimizer state, and ``load_best_model_at_end`` kept the last step's weights. DeepSpeed (its own
checkpoint files) and PEFT (``load_adapter``) read their checkpoints correctly and keep the Trainer's loads.

``use_converting_loads`` replaces the two loads of such a trainer with ``load_weights``: the folder read by
``from_pretrained``, which applies the model's key conversion, and copied into the model with every key required.
The read holds a second copy of the weights in CPU memory for the moment of the copy (a 3B model in fp32: ~15 GB).

``seed_each_epoch``: a run resumed after its first epoch trains on the uninterrupted run's data order.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

log = logging.getLogger("refine_rl.checkpoints")


def load_weights(model, folder: str) -> None:
    """The weights saved in ``folder`` (a checkpoint or any save_pretrained folder), read as from_pretrained reads
    them, copied into ``model`` in place; a key missing on either side is an error naming it."""
    saved = type(model).from_pretrained(folder, dtype=next(model.parameters()).dtype, device_map="cpu")
    result = model.load_state_dict(saved.state_dict(), strict=False)
    del saved  # the second copy goes before anything else runs
    if result.missing_keys or result.unexpected_keys:
        raise RuntimeError(
            f"{folder}: its weights do not match the model being trained: missing {result.missing_keys[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}"
        )
    log.info("loaded the weights of %s", folder)


def use_converting_loads(trainer) -> bool:
    """Resume and best-model loads through ``load_weights`` where the Trainer's own would load nothing: a full
    fine-tune outside DeepSpeed, FSDP and PEFT. Returns whether the trainer's loads were replaced."""
    from peft import PeftModel

    if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled or isinstance(trainer.model, PeftModel):
        return False

    def load_from_checkpoint(resume_from_checkpoint: str, model=None) -> None:
        load_weights(model if model is not None else trainer.model, resume_from_checkpoint)

    def load_best_model() -> None:
        load_weights(trainer.model, trainer.state.best_model_checkpoint)

    trainer._load_from_checkpoint = load_from_checkpoint
    trainer._load_best_model = load_best_model
    return True


def best_weights_step(state, load_best_model_at_end: bool) -> int | None:
    """The step of the checkpoint the Trainer loaded at the end (``state.best_model_checkpoint``), or None when it
    loaded none and the weights are the last step's. Not ``state.best_global_step``: the Trainer moves that to every
    evaluation that improves the metric, also one at a step with no checkpoint (``save_steps`` a multiple of
    ``eval_steps``), whose weights it then cannot load."""
    folder = state.best_model_checkpoint if load_best_model_at_end else None
    return int(Path(folder).name.rsplit("-", 1)[1]) if folder else None


def seed_each_epoch(trainer) -> None:
    """TRL's train sampler (``RepeatSampler``) seeds its own generator once and draws each epoch's permutation from it,
    with no ``set_epoch``. A run resumed in epoch e ≥ 1 builds a new sampler, whose first permutation is epoch 0's:
    it trained the rest of epoch e in epoch 0's order (questions the run had already seen in epoch e again, others
    never), and no longer ended on the uninterrupted run's weights. The sampler gets a ``set_epoch`` that reseeds it
    with seed + epoch, called at every epoch's start by a callback (``on_epoch_begin``, before the epoch's loader is
    iterated): transformers' own call does not reach the sampler in a resumed epoch with several processes
    (accelerate's skip wrapper goes around its per-process one, and its ``set_epoch`` looks two levels down)."""
    from transformers import TrainerCallback

    make = trainer._get_train_sampler
    samplers = []

    def train_sampler(*args, **kwargs):
        sampler = make(*args, **kwargs)
        if getattr(sampler, "shuffle", False) and getattr(sampler, "seed", None) is not None:
            if not hasattr(sampler, "set_epoch"):
                sampler.set_epoch = lambda epoch: sampler.generator.manual_seed(sampler.seed + epoch)
            samplers.append(sampler)
        return sampler

    class SeedEachEpoch(TrainerCallback):
        def on_epoch_begin(self, args, state, control, **kwargs):
            # the epoch the loop starts: state.epoch is e at the end of epoch e - 1 (e - 1 + n / n), and a resumed
            # run's saved e + k / n (k < n) within epoch e
            for sampler in samplers[-1:]:
                sampler.set_epoch(math.floor(state.epoch or 0))

    trainer._get_train_sampler = train_sampler
    trainer.add_callback(SeedEachEpoch())
