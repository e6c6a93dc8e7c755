"""The doctor's security check: would the bootstrap server and ZMQ control sockets listen
beyond loopback without a shared secret? Finds the address the way SGLang does."""

from __future__ import annotations

import ipaddress
import os
import socket

from sgl_nixl_plugin import settings
from sgl_nixl_plugin.cli.doctor_report import CheckResult, DoctorContext

#: Environment variables that carry the shared secret (see ``settings.read_secret``).
SECRET_ENV = "SGLANG_NIXL_PLUGIN_SECRET"
SECRET_FILE_ENV = "SGLANG_NIXL_PLUGIN_SECRET_FILE"
#: Where SGLang takes the address its KV control sockets bind to (``get_local_ip_auto``).
HOST_IP_ENVS = ("SGLANG_HOST_IP", "HOST_IP")
_LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}


def _socket_local_ip() -> str | None:
    """The address outbound traffic would leave from (a UDP connect sends nothing)."""
    for family, target in ((socket.AF_INET, "8.8.8.8"), (socket.AF_INET6, "2001:4860:4860::8888")):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((target, 80))
                return str(s.getsockname()[0])
        except OSError:
            continue
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return None


def listen_host() -> tuple[str | None, str]:
    """The host SGLang's KV managers bind their ZMQ sockets to, and where it comes from."""
    for name in HOST_IP_ENVS:
        value = os.environ.get(name, "")
        if value:
            return value, f"from {name}"
    try:
        from sgl_nixl_plugin.adapter.harness import local_ip_finder

        get_local_ip_auto = local_ip_finder()
    except Exception:
        return _socket_local_ip(), "auto-detected from this machine's sockets"
    try:
        return get_local_ip_auto(), "auto-detected by SGLang's get_local_ip_auto"
    except Exception:
        return None, "SGLang could not detect a local IP"


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and names that resolve only to them."""
    name = host.strip().strip("[]")
    try:
        return ipaddress.ip_address(name.split("%")[0]).is_loopback
    except ValueError:
        pass
    if name.lower() in _LOOPBACK_NAMES:
        return True
    try:
        infos = socket.getaddrinfo(name, None)
    except OSError:
        return False
    addrs = {info[4][0] for info in infos}
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def check_exposure(ctx: DoctorContext) -> list[CheckResult]:
    """Warn when the bootstrap server and control sockets would be reachable beyond
    loopback without a shared secret (anyone who reaches them could register ranks,
    learn rank addresses and inject control messages)."""
    from sgl_nixl_plugin.settings import read_secret

    host, source = listen_host()
    exposed = host is None or not is_loopback(host)
    secret_vars = settings.secret_vars_set()
    problem = ""
    try:
        has_secret = read_secret() is not None
    except ValueError as exc:
        has_secret, problem = False, str(exc)
    ctx.facts["listen_host"] = host
    ctx.facts["listen_host_source"] = source
    ctx.facts["listen_exposed"] = exposed
    ctx.facts["shared_secret"] = has_secret
    where = f"{host} ({source})" if host else f"an unknown address ({source})"
    name = "network exposure"
    if has_secret:
        return [
            CheckResult(
                name,
                "ok",
                f"bootstrap server and ZMQ control sockets listen on {where}; "
                f"HTTP routes and control messages are signed ({' / '.join(secret_vars)} is set)",
            )
        ]
    if not exposed:
        return [
            CheckResult(
                name,
                "ok",
                f"bootstrap server and ZMQ control sockets listen on loopback {where} only",
            )
        ]
    why = f" ({problem})" if problem else ""
    return [
        CheckResult(
            name,
            "warn",
            f"the bootstrap server and ZMQ control sockets would listen on {where}, beyond "
            f"loopback, without a shared secret{why}: anyone who can reach this host could "
            "register prefill ranks, learn rank addresses and inject KV control messages",
            f"set {SECRET_ENV}=<secret> (or {SECRET_FILE_ENV}=<path of a file holding it>) "
            "to the same value on every prefill and decode node; or, if prefill and decode "
            "share this host, SGLANG_HOST_IP=127.0.0.1",
        )
    ]
