"""gRPC server options shared by every server of the project (gate, picker, orchestrator, sidecar)."""

SERVER_OPTIONS = [
    ("grpc.max_concurrent_streams", 100_000),
    # Never share a port with a stale process (tests restart servers on the same port).
    ("grpc.so_reuseport", 0),
    # A burst of new streams (thousands of held requests at once, each one ext_proc stream) waits in
    # gRPC core until the asyncio server picks each up; with the defaults (1000 pending, then a hard
    # limit) the excess was cancelled and Envoy answered 500 (seen with 2,000 requests, grpcio 1.85).
    ("grpc.server.max_pending_requests", 100_000),
    ("grpc.server.max_pending_requests_hard_limit", 200_000),
    # ... and gRPC core cancels a call its server has not picked up within 30 s (the default of
    # GRPC_ARG_SERVER_MAX_UNREQUESTED_TIME_IN_SERVER_SECONDS, grpc/impl/channel_arg_names.h): on 2 loaded
    # cores a burst of 2,000 streams took longer than that to be picked up, and the last ones were cancelled
    # (Envoy: 500, or a request that never reached the gate's hold queue; CI, 2026-12-02). A held request may
    # wait as long as Envoy's ext_proc message timeout allows (up to MAX_MESSAGE_TIMEOUT_S, 3600 s), so
    # the core waits as long.
    ("grpc.server_max_unrequested_time_in_server", 3600),
    # Gates ping their state stream every 2 s (keepalive) to notice a black-holed connection.
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
    ("grpc.keepalive_permit_without_calls", 1),
]
