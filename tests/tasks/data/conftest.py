"""Fixtures shared by the data stages' tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def s3():
    """A bucket on moto's S3 server, listening on loopback; credentials and endpoint as fsspec reads them.
    One for the session: moto keeps its buckets per process, whichever server serves them."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options = {"endpoint_url": f"http://{host}:{port}", "key": "testing", "secret": "testing"}
    import s3fs

    fs = s3fs.S3FileSystem(**options)
    fs.mkdir("crawl")
    yield fs, options
    server.stop()
