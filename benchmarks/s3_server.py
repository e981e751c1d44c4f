"""A real S3 API on loopback, for the tests and ``benchmarks.scale``: the ``moto`` server on a free port.

``S3Server`` starts ``python -m moto.server`` as a child process, waits until it answers, creates a
bucket, and exposes the environment (``AWS_*``) under which ``s3fs`` and DCP's fsspec reader and
writer reach it. Nothing leaves the machine.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from types import TracebackType

from lightning_sharded._launch import free_port


class S3Server:
    """The moto S3 server as a context manager; ``url(path)`` gives ``s3://BUCKET/path``."""

    def __init__(self, bucket: str = "ckpts") -> None:
        self.bucket = bucket
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.env = {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        self._proc: subprocess.Popen[bytes] | None = None
        self._saved_env: dict[str, str | None] = {}

    def url(self, path: str = "") -> str:
        return f"s3://{self.bucket}/{path}".rstrip("/")

    def __enter__(self) -> S3Server:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                break
            except OSError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self._stop()
                    raise RuntimeError(f"the moto S3 server did not start on port {self.port}") from None
                time.sleep(0.1)
        for key, value in self.env.items():
            self._saved_env[key] = os.environ.get(key)
            os.environ[key] = value
        _forget_s3_clients()
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint).create_bucket(Bucket=self.bucket)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _forget_s3_clients()
        self._stop()

    def _stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


def _forget_s3_clients() -> None:
    """fsspec caches one S3 filesystem per set of options, endpoint included: drop it with the server."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
