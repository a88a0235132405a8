"""OpenAI's Responses API (``POST /v1/responses``) on top of chat completions: the request becomes the chat
request the chat route builds (request.py), its output the Responses objects and stream events (output.py),
and finished responses are kept for ``previous_response_id`` (store.py)."""
