"""A throwaway certificate authority made with the `openssl` command, for TLS tests.

    pki = Pki(tmp_path)            # ca.crt; server.crt/.key for 127.0.0.1 and localhost; client.crt/.key
    pki.ca, pki.server_cert, pki.server_key, pki.client_cert, pki.client_key   # paths
    pki.issue("other", ca=False)   # another leaf signed by the CA (cert, key)

EC P-256 keys: each is made in milliseconds. Nothing is mocked: the files are what a real deployment uses.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


def _openssl(*args: str) -> None:
    exe = shutil.which("openssl")
    assert exe, "the openssl command is missing (Debian package openssl)"
    r = subprocess.run([exe, *args], capture_output=True, text=True)
    assert r.returncode == 0, f"openssl {' '.join(args)} failed:\n{r.stderr}"


class Pki:
    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ca_key = self._key("ca")
        self.ca = self.dir / "ca.crt"
        _openssl("req", "-x509", "-new", "-key", str(self.ca_key), "-out", str(self.ca), "-days", "2",
                 "-subj", "/CN=kvwatt test CA", "-addext", "basicConstraints=critical,CA:TRUE",
                 "-addext", "keyUsage=critical,keyCertSign,cRLSign")
        self.server_cert, self.server_key = self.issue("server", "subjectAltName=IP:127.0.0.1,DNS:localhost",
                                                       "extendedKeyUsage=serverAuth")
        self.client_cert, self.client_key = self.issue("client", "extendedKeyUsage=clientAuth")

    def _key(self, name: str) -> Path:
        path = self.dir / f"{name}.key"
        _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path))
        return path

    def issue(self, name: str, *extensions: str) -> tuple[Path, Path]:
        """A leaf certificate for ``name`` signed by the CA, with the given X.509v3 extension lines."""
        key, csr, cert = self._key(name), self.dir / f"{name}.csr", self.dir / f"{name}.crt"
        ext = self.dir / f"{name}.ext"
        ext.write_text("\n".join(("basicConstraints=CA:FALSE", *extensions)) + "\n")
        _openssl("req", "-new", "-key", str(key), "-out", str(csr), "-subj", f"/CN={name}")
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(self.ca), "-CAkey", str(self.ca_key),
                 "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext))
        return cert, key
