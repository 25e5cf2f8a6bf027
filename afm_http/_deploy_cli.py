"""``afm deploy haproxy``: an HAProxy configuration for afm replicas.

Every replica serves the same model (``afm serve --drain-timeout 30 ...``);
HAProxy (2.6 or newer) spreads requests over them with the routing
``docs/deploy.md`` explains:

* a request without an ``X-Request-ID`` gets HAProxy's ``unique-id``
  (``hap-<uuid4>``) as its id, so afm streams under it, echoes it in the
  response headers, and the client can cancel by it;
* a generation request goes to the replica its ``X-Session-ID`` is pinned to
  (opt-in conversation affinity, stick table ``afm_sessions``), else to the
  consistent hash of its session id or, without one, of its request id;
  HAProxy records which replica took each request id (stick table ``afm_ids``);
* ``POST /v1/chat/completions/{id}/cancel`` goes to the replica recorded for
  ``{id}``, even when that replica is draining and out of rotation
  (``force-persist``), else to the hash of ``{id}``: the replica a request
  without a session was hashed to;
* ``/health`` decides who is in rotation (``inter 1s fall 2 rise 1``); a 503
  (a draining replica refusing new work), a refused connection or an empty
  response is retried on another replica (``retry-on``, ``option redispatch``);
* streams pass unbuffered (no compression, no body buffering), a client that
  leaves closes its server connection (afm frees the slot), and silent
  periods up to an hour are allowed (afm sends keepalive comments every 10 s);
* the admin listener has HAProxy's stats page (``/stats``), its Prometheus
  metrics per replica (``/metrics``) and each replica's own routes under
  ``/replicas/<name>/`` (``/replicas/r1/metrics``, ``/replicas/r1/health``,
  ``POST /replicas/r1/admin/drain``), which the public listener refuses.

``deploy/haproxy/afm.cfg`` is this command's output for three local replicas.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["HELP", "Replica", "add_arguments", "parse_replica", "render", "run"]

HELP = "write an HAProxy configuration that balances afm replicas (cancel-safe routing)"

_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,31}")
_HOSTPORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})")
_DURATION = re.compile(r"\d+(us|ms|s|m|h|d)?")


@dataclass(frozen=True, slots=True)
class Replica:
    """One ``afm serve`` behind the balancer: its server name and address."""

    name: str
    host: str
    port: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def parse_replica(text: str, index: int) -> Replica:
    """``HOST:PORT`` or ``NAME=HOST:PORT`` (named ``r<index>`` by default)."""
    name, sep, address = text.rpartition("=")
    if not sep:
        name = f"r{index}"
    if not _NAME.fullmatch(name):
        raise ValueError(f"replica name {name!r}: a letter, then up to 31 of [A-Za-z0-9_.-]")
    m = _HOSTPORT.fullmatch(address)
    if m is None or not 0 < int(m.group(2)) <= 65535:
        raise ValueError(f"replica {text!r}: expected HOST:PORT, [IPV6]:PORT or NAME=HOST:PORT")
    return Replica(name, m.group(1), int(m.group(2)))


def _bind(text: str) -> str:
    if text != "none" and _HOSTPORT.fullmatch(text) is None:
        raise argparse.ArgumentTypeError(f"{text!r}: expected HOST:PORT (or 'none')")
    return text


def _duration(text: str) -> str:
    if _DURATION.fullmatch(text) is None:
        raise argparse.ArgumentTypeError(f"{text!r}: an HAProxy duration such as 500ms, 1s, 10m, 1h")
    return text


def render(replicas: list[Replica], *, bind: str = "127.0.0.1:8000",
           admin_bind: str | None = "127.0.0.1:8404", check_interval: str = "1s",
           fall: int = 2, rise: int = 1, timeout: str = "1h", retries: int = 3,
           bufsize: int = 65536, stats_socket: str | None = None) -> str:
    """The configuration text (HAProxy 2.6 syntax; check it with ``haproxy -c -f FILE``)."""
    if not replicas:
        raise ValueError("at least one replica")
    names = [r.name for r in replicas]
    if len(set(names)) != len(names):
        raise ValueError(f"replica names must differ: {names}")
    servers = "\n".join(
        f"    server {r.name} {r.address} id {i} check" for i, r in enumerate(replicas, 1))
    direct = "\n".join(f"    server {r.name} {r.address} id {i}" for i, r in enumerate(replicas, 1))
    use_direct = "\n".join(
        f"    use-server {r.name} if {{ var(txn.afm_replica) -m str {r.name} }}" for r in replicas)
    socket = f"    stats socket {stats_socket} mode 600 level admin\n" if stats_socket else ""
    admin = "" if admin_bind is None else _ADMIN.format(
        admin_bind=admin_bind, names=" ".join(names), direct=direct, use_direct=use_direct)
    return _CONFIG.format(
        replicas=", ".join(f"{r.name}={r.address}" for r in replicas), socket=socket, bind=bind,
        timeout=timeout, check_interval=check_interval, fall=fall, rise=rise, retries=retries,
        bufsize=bufsize, servers=servers, admin=admin).rstrip("\n") + "\n"


_CONFIG = """\
# afm replicas behind HAProxy (2.6+): written by `afm deploy haproxy`; see docs/deploy.md.
# Replicas: {replicas}
# Check: haproxy -c -f THIS_FILE    Run: haproxy -f THIS_FILE

global
    log stdout format raw local0 info
    # a request is retried on another replica only if it fits one buffer (see afm_replicas):
    # 64 KiB holds a long conversation; a larger request gets the replica's 503 + Retry-After
    tune.bufsize {bufsize}
{socket}
defaults
    mode http
    log global
    option httplog
    # a client that left never reaches (or keeps) a replica: afm frees its slot
    option abortonclose
    # inactivity limits: afm sends an SSE ': keepalive' every 10 s while a stream is silent;
    # a non-streaming answer must come within 'timeout server'
    timeout connect 2s
    timeout client {timeout}
    timeout server {timeout}
    timeout tunnel {timeout}
    timeout http-request 60s
    timeout http-keep-alive 60s
    timeout queue 30s
    timeout check 2s
    # no 'compression': SSE frames pass as afm writes them; and each at once: without
    # http-no-delay HAProxy sends small frames with MSG_MORE and the kernel holds them back
    # (measured: +16 ms TTFT p50 for a lone stream, +42 ms at 8 streams)
    option http-no-delay

frontend afm
    bind {bind}
    # every request gets an id before balancing: the client's X-Request-ID, else HAProxy's
    # (afm accepts 1-128 chars of [A-Za-z0-9._:-] starting alphanumeric: hap-<uuid4> is one)
    unique-id-format hap-%[uuid]
    acl has_rid req.hdr(X-Request-ID) -m reg [^[:space:]]
    http-request set-header X-Request-ID %[unique-id] unless has_rid
    http-request capture req.hdr(X-Request-ID) len 128
    # a replica's own admin routes are reached through the admin listener only
    http-request deny deny_status 404 if {{ path_beg /admin/ /replicas/ }}
    # HAProxy's own answers in OpenAI's error envelope, as afm's are
    http-error status 404 content-type application/json string '{{"error":{{"message":"no such route","type":"invalid_request_error","param":null,"code":"not_found"}}}}'
    http-error status 502 content-type application/json string '{{"error":{{"message":"the replica failed to answer","type":"server_error","param":null,"code":"bad_gateway"}}}}'
    http-error status 503 content-type application/json string '{{"error":{{"message":"no replica is available: retry","type":"server_error","param":null,"code":"no_replica"}}}}' hdr Retry-After 1
    http-error status 504 content-type application/json string '{{"error":{{"message":"the replica did not answer in time","type":"server_error","param":null,"code":"gateway_timeout"}}}}'
    default_backend afm_replicas

backend afm_replicas
    # The routing key: the cancel's path id, else X-Session-ID (opt-in affinity), else X-Request-ID.
    acl cancel path_reg ^/v1/chat/completions/[^/]+/cancel$
    acl has_session req.hdr(X-Session-ID) -m found
    http-request set-var(txn.afm_key) path,field(5,/) if cancel
    http-request set-var(txn.afm_key) req.hdr(X-Session-ID) if !cancel has_session
    http-request set-var(txn.afm_key) req.hdr(X-Request-ID) if !cancel !has_session
    balance hash var(txn.afm_key)
    # sdbm + avalanche; a replica leaving or joining moves only its own share of the keys
    hash-type consistent
    # Which replica took each request id, for its cancel (and each session, for its next turn);
    # "store-request" records the replica that finally answered, after any retry.
    stick match var(txn.afm_key) table afm_ids if cancel
    stick match req.hdr(X-Session-ID) table afm_sessions if !cancel has_session
    stick store-request req.hdr(X-Request-ID) table afm_ids if METH_POST !cancel
    stick store-request req.hdr(X-Session-ID) table afm_sessions if METH_POST !cancel has_session
    # a draining replica (out of rotation) still gets the cancels of the streams it runs
    force-persist if cancel
    # Rotation: /health is 200 when ready; 503 when the generation thread died or while draining
    option httpchk GET /health
    http-check expect status 200
    default-server inter {check_interval} fall {fall} rise {rise}
    # A replica that refuses (draining: 503 + Retry-After), refuses the connection or drops it
    # before answering: the request is sent again, to another replica.  HAProxy can resend only
    # a request it holds whole: wait for the body (it is small) before choosing a replica, and
    # keep the whole request in one buffer (bodies past tune.bufsize are not retried).
    option http-buffer-request
    retries {retries}
    retry-on conn-failure empty-response 503
    option redispatch 1
    http-response set-header X-AFM-Replica %s
{servers}

backend afm_ids
    stick-table type string len 128 size 200k expire {timeout}

backend afm_sessions
    stick-table type string len 128 size 200k expire 1h
{admin}"""

_ADMIN = """
frontend afm_admin
    bind {admin_bind}
    stats enable
    stats uri /stats
    stats refresh 5s
    http-request use-service prometheus-exporter if {{ path /metrics }}
    # /replicas/<name>/<route>: that replica's own /metrics, /health, /admin/drain
    acl replica_path path_reg ^/replicas/[^/]+/
    http-request deny deny_status 404 unless replica_path || {{ path /metrics }} || {{ path_beg /stats }}
    use_backend afm_direct if replica_path

backend afm_direct
    http-request set-var(txn.afm_replica) path,field(3,/)
    http-request deny deny_status 404 unless {{ var(txn.afm_replica) -m str {names} }}
    http-request set-path %[path,regsub(^/replicas/[^/]+,)]
{use_direct}
{direct}
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="target", metavar="TARGET")
    sub.required = True
    hap = sub.add_parser("haproxy", help="an HAProxy 2.6+ configuration (docs/deploy.md)",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    hap.add_argument("--replica", action="append", required=True, metavar="[NAME=]HOST:PORT",
                     help="an afm serve replica (repeat for each; named r1, r2, ... by default)")
    hap.add_argument("--bind", type=_bind, default="127.0.0.1:8000",
                     help="where clients connect (default: 127.0.0.1:8000)")
    hap.add_argument("--admin-bind", type=_bind, default="127.0.0.1:8404",
                     help="stats page, Prometheus metrics and per-replica routes; keep it private "
                          "('none': no admin listener; default: 127.0.0.1:8404)")
    hap.add_argument("--check-interval", type=_duration, default="1s",
                     help="health check interval (default: 1s; out of rotation after 2 failures)")
    hap.add_argument("--timeout", type=_duration, default="1h",
                     help="client/server inactivity timeout, and how long a request id stays "
                          "routable for its cancel (default: 1h)")
    hap.add_argument("--stats-socket", default=None, metavar="PATH",
                     help="also open HAProxy's runtime API on this Unix socket")
    hap.add_argument("-o", "--output", default="-", help="file to write (default: stdout)")


def run(args: argparse.Namespace) -> int:
    try:
        replicas = [parse_replica(text, i) for i, text in enumerate(args.replica, 1)]
        text = render(replicas, bind=args.bind,
                      admin_bind=None if args.admin_bind == "none" else args.admin_bind,
                      check_interval=args.check_interval, timeout=args.timeout,
                      stats_socket=args.stats_socket)
    except ValueError as exc:
        print(f"afm deploy haproxy: {exc}", file=sys.stderr)
        return 2
    if args.output == "-":
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text)
    return 0
