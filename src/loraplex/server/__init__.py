"""OpenAI-compatible HTTP server: routes, admin API, auth and metrics over the engine client."""
