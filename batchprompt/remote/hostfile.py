"""Hostfiles: where the pool's servers are.

One endpoint a line, in any of these forms, then optional `key=value` tags:

    # a comment (and blank lines) are skipped
    gpu-node-01:8000 weight=2
    gpu-node-02 8000
    http://10.0.0.7:8001/v1 role=spare
    https://llm.example.org

`weight` (a number > 0, default 1) scales how much work the endpoint gets relative to the
others; every tag is kept on the endpoint (`EndpointSpec.tags`). A bad line is an error naming
the file, the line and the fix.
"""
from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable
from urllib.parse import urlsplit

#: host:port, as a hostfile line gives an endpoint (a name, IPv4, or [IPv6]), with no file of that name
HOST_PORT = re.compile(r"(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):\d{1,5}(/\S*)?")


class HostfileError(ValueError):
    """A hostfile or endpoint that cannot be read; the message names the line and the fix."""


@dataclass(frozen=True)
class EndpointSpec:
    """One server: its base URL (scheme://host:port, no trailing /v1) and its tags."""

    url: str
    tags: dict[str, str] = field(default_factory=dict)

    @property
    def weight(self) -> float:
        return float(self.tags.get("weight", 1))

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    @property
    def port(self) -> int:
        parts = urlsplit(self.url)
        return parts.port or (443 if parts.scheme == "https" else 80)


FORMS = "host:port, 'host port', or a URL such as http://host:port"


def parse_endpoint(text: str, tags: dict[str, str] | None = None, where: str = "") -> EndpointSpec:
    """`host:port`, `host port` or a URL (an http(s) base URL; a trailing /v1 is dropped)."""
    where = where or repr(text)
    words = text.split()
    if not words:
        raise HostfileError(f"{where}: empty endpoint; give {FORMS}")
    if len(words) == 2 and words[1].isdigit():
        url = f"http://{words[0]}:{words[1]}"
    elif len(words) == 1:
        url = words[0] if "://" in words[0] else f"http://{words[0]}"
    else:
        raise HostfileError(f"{where}: cannot read {text!r} as an endpoint; give {FORMS}, then key=value tags")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:  # a port that is not a number, or out of range
        raise HostfileError(f"{where}: bad port in {text!r} ({e}); give {FORMS}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise HostfileError(f"{where}: {text!r} is not an http(s) endpoint; give {FORMS}")
    if port is None and "://" not in words[0]:
        raise HostfileError(f"{where}: {text!r} has no port; give host:port (e.g. {words[0]}:8000)")
    path = parts.path.rstrip("/")
    for route in ("/chat/completions", "/completions"):  # a route's URL pasted for the server's
        if path.endswith("/v1" + route):
            path = path[:-len(route)]
    if path.endswith("/v1"):
        path = path[:-3]
    netloc = parts.hostname if port is None else f"{_host(parts.hostname)}:{port}"
    spec = EndpointSpec(f"{parts.scheme}://{netloc}{path}", dict(tags or {}))
    _check_tags(spec.tags, where)
    return spec


def parse_hostfile(path: str | Path) -> list[EndpointSpec]:
    """The endpoints of a hostfile, in file order (see the module's docstring)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        missing = isinstance(e, FileNotFoundError)
        hint = ""
        if missing and re.fullmatch(r"[A-Za-z0-9.-]+|\[[0-9a-fA-F:.]+\]", str(path)):
            hint = f" (if {str(path)!r} is a server, give its port: {path}:8000)"
        elif missing and len(str(path).split()) > 1:  # servers joined by spaces: read as one file's name
            hint = f" (several servers are joined by commas: {','.join(str(path).split())})"
        raise HostfileError(f"cannot read the hostfile {p}: {e.strerror or e}{hint}") from None
    except UnicodeDecodeError:
        raise HostfileError(f"{p} is not UTF-8 text: a hostfile lists one endpoint (host:port) a line") from None
    out = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        words = line.split()
        tags, address = {}, []
        for w in words:
            if "=" in w and "://" not in w:
                key, _, value = w.partition("=")
                if not key or not value:
                    raise HostfileError(f"{p}:{n}: bad tag {w!r}: tags are key=value (e.g. weight=2)")
                tags[key] = value
            elif tags:
                raise HostfileError(f"{p}:{n}: {w!r} after the tags: the endpoint comes first, then key=value tags")
            else:
                address.append(w)
        out.append(parse_endpoint(" ".join(address), tags, f"{p}:{n}"))
    if not out:
        raise HostfileError(f"{p} lists no endpoint: write one host:port a line")
    return out


def endpoint_specs(endpoints: str | Path | Iterable[str | EndpointSpec]) -> list[EndpointSpec]:
    """A hostfile path, or a list of endpoints (strings in the hostfile's forms, or specs). A
    string that is a URL, or URLs joined by commas, is those endpoints, as vLLM's and OpenAI's
    users write a server: `http://127.0.0.1:8000/v1` (no file of that name is looked for)."""
    if isinstance(endpoints, str) and not endpoints.strip():  # it read the hostfile "." ("Is a directory")
        raise HostfileError("no endpoints given: pass a hostfile path, 'host:port' (several joined by commas) or "
                            "a URL such as http://127.0.0.1:8000/v1")
    if isinstance(endpoints, str) and ("://" in endpoints or _host_ports(endpoints)):
        return endpoint_specs([e.strip() for e in endpoints.split(",") if e.strip()] or [endpoints])
    if isinstance(endpoints, (str, Path)):
        return _once_each(parse_hostfile(endpoints))
    out = []
    for i, e in enumerate(endpoints):
        if isinstance(e, EndpointSpec):
            _check_tags(e.tags, f"endpoint {i}")
            out.append(e)
        elif isinstance(e, str):
            words = e.split()
            tags = dict(w.split("=", 1) for w in words if "=" in w and "://" not in w)
            out.append(parse_endpoint(" ".join(w for w in words if not ("=" in w and "://" not in w)), tags,
                                      f"endpoint {i} ({e!r})"))
        else:
            raise HostfileError(f"endpoint {i} is a {type(e).__name__}: give 'host:port' strings or a hostfile path")
    if not out:
        raise HostfileError("no endpoints given: pass a hostfile path or a list such as ['host1:8000', 'host2:8000']")
    return _once_each(out)


def _once_each(specs: list[EndpointSpec]) -> list[EndpointSpec]:
    """`specs`, or an error naming a server listed twice (as host:port or as its URL alike: a
    hostfile's were not checked, and the server got twice its share)."""
    seen: set[str] = set()
    for s in specs:
        if s.url in seen:
            raise HostfileError(f"the endpoint {s.url} is listed twice: list each server once (weight=2 for more work)")
        seen.add(s.url)
    return specs


def _host_ports(text: str) -> bool:
    """Whether `text` is host:port endpoints joined by commas (and no file of that name)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    return bool(parts) and not Path(text).exists() and all(HOST_PORT.fullmatch(p) for p in parts)


def _check_tags(tags: dict[str, str], where: str) -> None:
    for key in tags:  # any tag is kept, but one a letter or two off weight is a typo (it was ignored)
        if key != "weight" and difflib.get_close_matches(key.lower(), ["weight"], n=1, cutoff=0.7):
            raise HostfileError(f"{where}: unknown tag {key!r}: did you mean weight={tags[key]}?")
    if "weight" in tags:
        try:
            w = float(tags["weight"])
        except ValueError:
            w = float("nan")
        if not (math.isfinite(w) and w > 0):
            raise HostfileError(f"{where}: weight must be a number > 0, got {tags['weight']!r}")


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host  # IPv6
