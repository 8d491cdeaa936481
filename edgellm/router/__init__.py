"""Hybrid edge/cloud routing: a policy file, per-request decisions, remote OpenAI-compatible endpoints."""
