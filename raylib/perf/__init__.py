"""Performance model, cost and TCO: predict a job before it runs, price it, compare hardware."""
