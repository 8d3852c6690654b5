"""The training runtime every recipe runs on: the run (hardware choices, parallel context, run
directory, resolved config), the batch split, and the one training loop (log, evaluate, checkpoint,
resume, summary). Recipes supply a step function; see docs/architecture.md."""
