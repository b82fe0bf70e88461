"""Ray Train x DeepSpeed: strategy -> ds_config, the per-worker loop, and the trainer."""
