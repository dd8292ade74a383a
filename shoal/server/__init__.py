"""The OpenAI-compatible HTTP server: completions, chat, files and the Batch API."""
