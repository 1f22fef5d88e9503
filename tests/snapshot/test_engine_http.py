"""The backends' HTTP client to their engine: no TLS context for http://, one verifying context for https://."""

from __future__ import annotations

import ssl

from llmd_timeslice import http_tls
from llmd_timeslice.snapshot.backends import engine_http
from tests.support.fake_engines import FakeVllm


async def test_an_http_engine_is_reached_without_building_a_tls_context(monkeypatch):
    def no_tls(*args, **kwargs):
        raise AssertionError("a TLS context was built for an http:// engine")

    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", no_tls)
    engine = FakeVllm().start()
    try:
        async with engine_http.engine_http_client(engine.url, 5) as c:
            r = await c.get("/health")
        assert r.status_code == 200
    finally:
        engine.stop()


def test_https_engines_share_one_verifying_context():
    a = engine_http.engine_http_client("https://engine-a:8000", 5)
    b = engine_http.engine_http_client("https://engine-b:8000", 5)
    ctx = http_tls._tls_context()
    assert ctx is http_tls._tls_context() and ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert a._transport._pool._ssl_context is ctx and b._transport._pool._ssl_context is ctx
