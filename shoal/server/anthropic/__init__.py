"""Anthropic-compatible routes: `/v1/messages` (streamed or not) and Message Batches.

Same engine, same store and batch runner as the OpenAI routes: a message batch is a batch
over `/v1/messages` lines, so it resumes after a restart exactly like an OpenAI one. Requests
are translated to the chat path (`protocol`, `messages`), answers and batch objects to
Anthropic's shapes (`formatting`), and every error under `/v1/messages` leaves as Anthropic's
`{"type": "error", "error": {...}}`.
"""
