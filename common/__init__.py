"""What the services, the gateway, the engine's entry points, the benchmarks and the tests share: gRPC server
helpers, the status mapping of Sluice's typed errors, the multiplexer of requests over one bidirectional
call (``stream_mux``), and process helpers (free ports, child processes)."""
