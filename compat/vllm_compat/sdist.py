"""Finding vLLM's sdist through pip's own index configuration, downloading and unpacking it.

``pip download`` is not used: for an sdist it runs vLLM's setup.py to learn the version, which
needs a build toolchain and, with ``VLLM_TARGET_DEVICE=empty``, reports ``0.33.0+empty``. The
indexes are the ones pip itself would ask (``index-url``, ``extra-index-url``, ``find-links``
from pip's config files and ``PIP_*`` variables), over the simple API (PEP 691 JSON, or PEP 503
HTML); the sha256 the index gives is checked. Nothing from the sdist is copied into the
repository.
"""

from __future__ import annotations

import dataclasses
import hashlib
import html.parser
import json
import shutil
import ssl
import tarfile
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from .errors import SetupError
from .scope import PROJECT, SCOPES, SDIST, VERSION


@dataclasses.dataclass(frozen=True)
class IndexConfig:
    index_urls: tuple[str, ...]
    find_links: tuple[str, ...]
    cert: str | None


def pip_index_config(args: Sequence[str] = ()) -> IndexConfig:
    """The indexes pip itself would ask, from its config files, ``PIP_*`` variables and ``args``."""
    try:
        from pip._internal.commands import create_command
    except ImportError as exc:
        raise SetupError(f"pip is not importable ({exc}); run this with the project's venv python") from exc
    options, _ = create_command("download").parse_args(list(args))
    urls = () if options.no_index else (options.index_url, *options.extra_index_urls)
    return IndexConfig(tuple(urls), tuple(options.find_links), options.cert)


@dataclasses.dataclass(frozen=True)
class Candidate:
    url: str
    sha256: str | None


class _Anchors(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self.hrefs += [v for k, v in attrs if k == "href" and v]


def parse_project_page(body: bytes, content_type: str, base_url: str, filename: str) -> Candidate | None:
    """The link to ``filename`` on one simple-API project page (PEP 691 JSON or PEP 503 HTML)."""
    if "json" in content_type:
        for entry in json.loads(body).get("files", ()):
            if entry.get("filename") == filename:
                return Candidate(
                    urllib.parse.urljoin(base_url, entry["url"]), entry.get("hashes", {}).get("sha256")
                )
        return None
    anchors = _Anchors()
    anchors.feed(body.decode("utf-8", "replace"))
    for href in anchors.hrefs:
        url, _, fragment = urllib.parse.urljoin(base_url, href).partition("#")
        if urllib.parse.unquote(url.rsplit("/", 1)[-1]) == filename:
            algo, _, digest = fragment.partition("=")
            return Candidate(url, digest if algo == "sha256" and digest else None)
    return None


def _ssl_context(cert: str | None) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=cert) if cert else ssl.create_default_context()


def _fetch(url: str, cert: str | None, accept: str | None = None) -> tuple[bytes, str, str]:
    if url.startswith("file:"):
        path = Path(urllib.request.url2pathname(urllib.parse.urlparse(url).path))
        if path.is_dir():
            path = path / "index.html"
        return path.read_bytes(), "text/html", path.as_uri()
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=120, context=_ssl_context(cert)) as response:
        return response.read(), response.headers.get("Content-Type", ""), response.geturl()


_ACCEPT = "application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.01"


def find_sdist(config: IndexConfig, filename: str = SDIST, project: str = PROJECT) -> Candidate:
    """Ask each index and find-links location in pip's order; the first that lists the file wins."""
    tried: list[str] = []
    for location in config.find_links:
        local = (
            Path(urllib.request.url2pathname(urllib.parse.urlparse(location).path))
            if "://" in location
            else Path(location)
        )
        if (local / filename).is_file():
            return Candidate((local / filename).as_uri(), None)
        tried.append(location)
    for index in config.index_urls:
        page = index.rstrip("/") + f"/{project}/"
        try:
            body, content_type, final_url = _fetch(page, config.cert, _ACCEPT)
        except (OSError, ValueError) as exc:
            tried.append(f"{page} ({exc})")
            continue
        found = parse_project_page(body, content_type, final_url, filename)
        if found is not None:
            return found
        tried.append(f"{page} (no {filename})")
    raise SetupError(
        f"{filename} is on none of pip's indexes: {'; '.join(tried) or 'none configured'}; "
        "set PIP_INDEX_URL (or index-url in pip.conf) to an index that has it"
    )


def download(candidate: Candidate, dest: Path, cert: str | None) -> Path:
    """``dest``, downloaded once and checked against the index's sha256 when it gives one."""
    if dest.is_file() and (candidate.sha256 is None or _sha256(dest) == candidate.sha256):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".part")
    body, _, _ = _fetch(candidate.url, cert)
    partial.write_bytes(body)
    if candidate.sha256 is not None and (got := _sha256(partial)) != candidate.sha256:
        partial.unlink()
        raise SetupError(
            f"{candidate.url}: sha256 {got} is not the index's {candidate.sha256}; download it again"
        )
    partial.replace(dest)
    return dest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def unpack(archive: Path, into: Path) -> Path:
    """The sdist's top folder under ``into``, unpacked once (a marker says it finished)."""
    top = into / archive.name.removesuffix(".tar.gz")
    marker = top / ".unpacked"
    if marker.is_file():
        return top
    shutil.rmtree(top, ignore_errors=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    missing = [scope for scope in SCOPES if not (top / scope).exists()]
    if missing:
        raise SetupError(f"{archive}: no {', '.join(missing)} in the sdist; it is not vLLM {VERSION}'s")
    marker.touch()
    return top
