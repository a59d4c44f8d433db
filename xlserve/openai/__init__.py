"""The OpenAI-compatible front end shared by the worker and the router: request models,
chat and completion serving, conversation rendering, tool parsers, errors, pricing and the
HTTP app, typed against ``engine_client.EngineClient``. Imports no torch."""
