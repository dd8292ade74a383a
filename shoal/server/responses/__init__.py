"""OpenAI's Responses API (`/v1/responses`) over the shared chat path, with stored responses
and `previous_response_id` chains that are engine sessions.

`protocol` (request bodies), `items` (input items and tools in the chat shape), `prompt` (a
chain's prompt, continued token for token), `events` (output items and stream events),
`output` (the response object), `background` (background responses' tasks and event logs),
`service` (creating, running, storing, cancelling), `routes` (the HTTP routes). The store's
side is `shoal.server.store.responses`.
"""
