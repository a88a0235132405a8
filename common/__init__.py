"""What the services, the gateway, the engine's entry points, the benchmarks and the tests share: gRPC server
helpers, the status mapping of Sluice's typed errors, and process helpers (free ports, child processes)."""
