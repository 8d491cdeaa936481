"""OpenAI-compatible HTTP server (`edgellm serve`); needs the `serve` extra (fastapi, uvicorn)."""
