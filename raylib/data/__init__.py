"""Data: corpus generation and build, and the trainer's data source (Ray Data)."""
