"""Ways into the engine: the token-level gRPC servicer, the asyncio engine, the offline ``LLM``, the CLI."""
