"""The Copy API over gRPC, without generated stubs: CopyRequest and
CopyProgress (proto/rcp/v1/rcp.proto) are small enough to encode here, and
grpcio's generic calls take any serializer. Needs grpcio."""

DIRECTIONS = {"push": 1, "pull": 2}
# rcp --verify's names and their Check values in the proto.
CHECKS = {"blake3": 4, "sha256": 1, "xxh3": 2, "none": 3}
METHOD = "/rcp.v1.Rcp/Copy"


def _varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field(num, value):
    if isinstance(value, bool):
        return _varint(num << 3) + _varint(int(value)) if value else b""
    if isinstance(value, int):
        return _varint(num << 3) + _varint(value) if value else b""
    b = value.encode() if isinstance(value, str) else value
    return _varint((num << 3) | 2) + _varint(len(b)) + b if b else b""


def _check(name):
    """The proto value of check `name`, named exactly (lower case) as
    everywhere in rcp; another name raises ValueError listing them."""
    try:
        return CHECKS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown check {name!r}: blake3, sha256, xxh3 or none") from None


def encode_request(direction, local_path, remote, remote_path, recursive=False, preserve=False,
                   resume=False, remote_token="", transport="", block_size=0, checks=(),
                   fanout=()):
    """A CopyRequest's bytes. `checks`: names of CHECKS, preferred first
    (empty: the copying rcpd's default, blake3 then sha256). `fanout`:
    further rcpds ("host:port") the push goes on to, in chain order
    (docs/fanout.md)."""
    return b"".join([
        _field(1, DIRECTIONS[direction]), _field(2, local_path), _field(3, remote),
        _field(4, remote_path), _field(5, bool(recursive)), _field(6, bool(preserve)),
        _field(7, bool(resume)), _field(8, remote_token or ""), _field(9, transport or ""),
        _field(10, int(block_size or 0)),
        # repeated Check checks = 11, packed.
        _field(11, b"".join(_varint(_check(c)) for c in checks)),
        # repeated string fanout = 14: one field per node.
        b"".join(_field(14, n) for n in fanout),
    ])


def _fields(b):
    """(number, value) of each field of a message: an int for a varint,
    bytes for a length-delimited field (fixed-size ones skipped)."""
    i = 0
    while i < len(b):
        key, i = _read_varint(b, i)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, i = _read_varint(b, i)
            yield num, v
        elif wt == 2:
            n, i = _read_varint(b, i)
            yield num, b[i:i + n]
            i += n
        elif wt == 1:
            i += 8
        elif wt == 5:
            i += 4
        else:
            raise ValueError("bad wire type %d" % wt)


def _read_varint(b, i):
    n = shift = 0
    while True:
        c = b[i]
        i += 1
        n |= (c & 0x7F) << shift
        shift += 7
        if not c & 0x80:
            return n, i


def decode_progress(b):
    """A CopyProgress as a dict; `nodes`: a fan-out's NodeResults
    (decode_node)."""
    ints = {1: "bytes_done", 2: "bytes_total", 3: "files_done", 4: "files_total"}
    out = {"bytes_done": 0, "bytes_total": 0, "files_done": 0, "files_total": 0, "done": False,
           "sha256": "", "error": "", "nodes": []}
    for num, v in _fields(b):
        if num in ints:
            out[ints[num]] = v
        elif num == 5:
            out["done"] = bool(v)
        elif num in (6, 7):
            out["sha256" if num == 6 else "error"] = v.decode()
        elif num == 8:
            out["nodes"].append(decode_node(v))
    return out


def decode_node(b):
    """A NodeResult (one node of a fan-out) as a dict: node, done,
    unreachable, error."""
    out = {"node": "", "done": False, "unreachable": False, "error": ""}
    for num, v in _fields(b):
        if num in (1, 4):
            out["node" if num == 1 else "error"] = v.decode()
        elif num in (2, 3):
            out["done" if num == 2 else "unreachable"] = bool(v)
    return out


def channel(target, tls_ca=None, tls_cert=None, tls_key=None, server_name=None):
    """A gRPC channel to rcpd: `target` is HOST:PORT or a socket path
    (`unix:PATH` or an absolute path)."""
    import grpc

    if target.startswith("/"):
        target = "unix:" + target
    # grpcio names a unix socket's path as the HTTP/2 :authority, which is
    # not a valid authority: rcpd's HTTP/2 server refuses the stream.
    local = [("grpc.default_authority", "localhost")] if target.startswith("unix:") else []
    if not tls_ca:
        return grpc.insecure_channel(target, options=local)

    def read(p):
        with open(p, "rb") as f:
            return f.read()

    creds = grpc.ssl_channel_credentials(
        root_certificates=read(tls_ca),
        private_key=read(tls_key) if tls_key else None,
        certificate_chain=read(tls_cert) if tls_cert else None,
    )
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return grpc.secure_channel(target, creds, options=options)


def copy_stream(ch, token, timeout=None, **req):
    """Progress dicts of one Copy on channel `ch`; grpc.RpcError on a
    failed status."""
    call = ch.unary_stream(METHOD, request_serializer=lambda b: b,
                           response_deserializer=decode_progress)
    metadata = [("authorization", "Bearer " + token)] if token else []
    return call(encode_request(**req), metadata=metadata, timeout=timeout)


def copy(path, token, direction, local_path, remote, remote_path, recursive, preserve, resume,
         remote_token, transport, block_size, checks=(), fanout=()):
    ch = channel(path)
    for p in copy_stream(ch, token, direction=direction, local_path=local_path, remote=remote,
                         remote_path=remote_path, recursive=recursive, preserve=preserve,
                         resume=resume, remote_token=remote_token, transport=transport,
                         block_size=block_size, checks=checks, fanout=fanout):
        yield p
    ch.close()
