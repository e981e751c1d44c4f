"""The moto S3 server of the tests: it lives in ``benchmarks.s3_server`` (``benchmarks.scale`` uses it too;
the benchmarks import nothing from the tests)."""

from __future__ import annotations

from benchmarks.s3_server import S3Server

__all__ = ["S3Server"]
