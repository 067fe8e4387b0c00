"""Scripts written for a framework (Lightning, Hugging Face ``Trainer``, ``accelerate``) under a plan.

Under ``chameleon-run --job`` an unmodified script sees an ordinary torchrun world, but a
re-plan changes it: fewer workers, each with a larger share of the global batch
(``CHAMELEON_MICRO_BATCHES`` micro-batches of ``CHAMELEON_MICRO_BATCH_SIZE`` samples per step).
A script keeps the global batch only if it takes its gradient-accumulation steps and its
per-device batch from the plan. :mod:`.share` reads that share from the environment and tells
the launcher that the script follows it (so the launcher says nothing when a plan changes it);
the framework modules turn it into each framework's own settings, one line in a script:

- ``lightning_plan``: ``Trainer(**lightning_plan.trainer_kwargs(devices=2, strategy="ddp"), ...)``
- ``hf_trainer``: ``TrainingArguments(**hf_trainer.training_args(per_device_train_batch_size=8),
  ...)``
- ``accelerate_plan``: ``Accelerator(**accelerate_plan.accelerator_kwargs(), ...)``

(``following`` is what they share: the share, announced once.) docs/frameworks.md says what
works unmodified, what one line adds, what resuming needs in each framework, and what in-place
recovery needs.

Importing this package imports no framework and no torch: each adapter imports its framework
when it is used.
"""
