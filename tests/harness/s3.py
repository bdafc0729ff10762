"""An S3-compatible server on 127.0.0.1 for the object tier's tests: ``moto``'s server mode.

It is an emulator: real S3 cannot run here. ``moto`` (PyPI, the ``test`` extra)
was picked over ``s3rver`` (npm) because it installs into the same Python
environment as everything else and answers every request NIXL's OBJ backend
sends (PUT, ranged GET, HEAD, multipart). It does not check signatures, so
:meth:`S3Server.damage` can overwrite an object with a plain PUT.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import requests

from sglang_kvbm.ops.demo.server import free_port, stop_group

# moto checks no signature, but refuses an anonymous overwrite of an object written with credentials
_ANY_SIGNATURE = {"Authorization": "AWS4-HMAC-SHA256 Credential=testing/20260101/us-east-1/s3/aws4_request, "
                                   "SignedHeaders=host, Signature=0"}
ACCESS_KEY = SECRET_KEY = "testing"
REGION = "us-east-1"


class S3Server:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self.port = free_port()
        self.proc: Optional[subprocess.Popen] = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> None:
        log = open(self.log_dir / "s3.log", "ab")
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto exited with {self.proc.returncode} (see {self.log_dir}/s3.log)")
            try:
                if requests.get(f"{self.endpoint}/moto-api/", timeout=1).ok:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"moto not ready in {timeout:.0f}s")

    def create_bucket(self, bucket: str) -> None:
        requests.put(f"{self.endpoint}/{bucket}", timeout=30).raise_for_status()

    def keys(self, bucket: str) -> list[str]:
        import xml.etree.ElementTree as ET

        reply = requests.get(f"{self.endpoint}/{bucket}?list-type=2", headers=_ANY_SIGNATURE, timeout=30)
        reply.raise_for_status()
        return [e.text for e in ET.fromstring(reply.content).iter() if e.tag.endswith("Key")]

    def damage(self, bucket: str, key: str, content: bytes) -> None:
        """Replace an object's bytes behind the tier's back."""
        requests.put(f"{self.endpoint}/{bucket}/{key}", data=content, headers=_ANY_SIGNATURE,
                     timeout=30).raise_for_status()

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_group(proc, grace=5.0)

    def __enter__(self) -> "S3Server":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
