"""HTTP serving: OpenAI-compatible routes and Prometheus metrics."""
