"""Private telemetry: metadata-only generation events in a local SQLite file, off until enabled.

Never recorded: prompt or output text, error messages, file paths. See docs/deploy.md for the fields.
"""
