"""Real documents from Debian's documentation packages: fetched with ``apt-get download``,
unpacked with ``dpkg-deb -x`` into a cache (nothing is installed), their PDFs listed.

Debian is one of the registries these machines reach, and its ``*-doc`` packages hold thousands of
born-digital PDF manuals whose text layer is exact ground truth (:mod:`components.data.text_layer`).
"""

from __future__ import annotations

import gzip
import subprocess
from pathlib import Path


class PackageFetchError(RuntimeError):
    """A Debian package could not be downloaded or unpacked."""


def fetch_package(cache: Path, package: str) -> Path:
    """The folder ``package`` is unpacked into (``cache/root/<package>``), downloading it once."""
    root = cache / "root" / package
    done = root / ".unpacked"
    if done.exists():
        return root
    debs = cache / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    found = sorted(debs.glob(f"{package}_*.deb"))
    if not found:
        result = subprocess.run(["apt-get", "download", package], cwd=debs, capture_output=True, text=True)
        found = sorted(debs.glob(f"{package}_*.deb"))
        if result.returncode != 0 or not found:
            raise PackageFetchError(f"could not download Debian package {package} (apt-get download: "
                                    f"{result.stderr.strip()[-300:]}); run `apt-get update` first or copy the .deb "
                                    f"into {debs}")
    root.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(["dpkg-deb", "-x", str(found[-1]), str(root)], capture_output=True, text=True)
    if result.returncode != 0:
        raise PackageFetchError(f"dpkg-deb could not unpack {found[-1]}: {result.stderr.strip()[-300:]}")
    done.touch()
    return root


def package_file(cache: Path, package: str, path: str) -> Path:
    """One file of a package (``path`` inside it), fetching the package if needed."""
    file = fetch_package(cache, package) / path
    if not file.exists():
        raise PackageFetchError(f"{package} has no {path}")
    return file


def package_pdfs(cache: Path, package: str) -> list[Path]:
    """Every PDF a package ships (compressed ``.pdf.gz`` ones unpacked next to them), sorted."""
    root = fetch_package(cache, package)
    for packed in sorted(root.rglob("*.pdf.gz")):
        target = packed.with_suffix("")
        if not target.exists():
            target.write_bytes(gzip.decompress(packed.read_bytes()))
    return sorted(p for p in root.rglob("*.pdf") if p.is_file())
