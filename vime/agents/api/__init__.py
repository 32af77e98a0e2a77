"""The wire formats vime's agent endpoint speaks: OpenAI chat completions, the OpenAI Responses API and the
Anthropic Messages API. Each module translates its requests into one chat request and one `Completion` back into
its responses and stream events; `vime.agents.openai_server` owns the HTTP side and the recording."""
