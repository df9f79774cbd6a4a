"""Tasks for models and data users bring: :mod:`geofed.tasks.hf` trains a Hugging Face
causal language model on each region's own files. Every coordinator may import the
modules of this package (:data:`geofed.task.DEFAULT_TASK_MODULES`)."""
