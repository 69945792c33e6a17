"""The OpenAI HTTP gateway: Litestar routes, SSE, admission into the Redis queue, auth."""
