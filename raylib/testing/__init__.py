"""Test and benchmark harnesses that need more than mocks: real clusters, real (slow) networks.

Nothing here is imported by the training path; modules may need root (see each one's `can_*`).
"""
