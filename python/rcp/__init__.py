"""rcp: the service client of rcpd (docs/buffers.md).

A service connects to its node's rcpd over the unix socket, hands it
buffers (memfds it maps too: zero copy), exposes them under names and moves
ranges to or from buffers other services exposed on other nodes' rcpds.

    import rcp
    c = rcp.connect()                      # RCP_SOCKET, else /run/rcp/rcpd.sock
    buf = c.create_buffer(64 << 20)        # buf.view: a writable memoryview
    c.expose(buf, "kv0", access="rw")
    h = c.write(buf, "node-b:7471", "kv0", [(0, 0, 1 << 20)], message="layer 0")
    h.wait()                               # {'state': 'done', 'bytes': ...}
    ev = c.next_event(timeout=5)           # {'event': 'written', ...} for our exposures

The buffer API needs only the standard library. The Copy API
(`Client.copy`) speaks gRPC to rcpd on the same socket and needs grpcio
(`pip install ./python[copy]`).
"""

import fcntl
import json
import mmap
import os
import queue
import socket
import struct
import threading

__all__ = ["connect", "Client", "Buffer", "Handle", "RcpError", "DEFAULT_SOCKET", "HUGE_PAGE"]

DEFAULT_SOCKET = "/run/rcp/rcpd.sock"
HUGE_PAGE = 2 << 20
MAGIC = b"RCPB"
VERSION = 1
# The room one recv reads rcpd's socket into (grown for larger frames).
READ_CHUNK = 1 << 18
_LEN = struct.Struct("<I")
# A caller's slot holds this when the socket is handed to it to read.
_TURN = object()


class RcpError(Exception):
    """An error rcpd answered: `reason` (invalid, not_found, permission,
    exceeded, retryable, integrity, unauthenticated, protocol, other) and a
    message."""

    def __init__(self, reason, message):
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


class Buffer:
    """A memfd this process maps and rcpd maps too. `view` is a writable
    memoryview of all of it (numpy: `np.frombuffer(buf.view, dtype)`)."""

    def __init__(self, client, buffer_id, size, mm, huge):
        self.client = client
        self.id = buffer_id
        self.size = size
        self.huge = huge
        self._mm = mm
        self.view = memoryview(mm)

    def __len__(self):
        return self.size

    def release(self):
        """Tell rcpd to let go (after its operations on it retired)."""
        self.client.release(self)

    def __repr__(self):
        return f"Buffer(id={self.id}, size={self.size}, huge={self.huge})"


class Handle:
    """An operation in flight: wait, status, cancel."""

    def __init__(self, client, handle):
        self.client = client
        self.id = handle

    def wait(self, timeout=None):
        """The final state (`{'state': 'done', 'bytes': N}`), or
        `{'state': 'running'}` after `timeout` seconds. A failed
        operation's state is 'failed' with 'failure': {reason, message}."""
        f = {"handle": self.id}
        if timeout is not None:
            f["timeout_ms"] = int(timeout * 1000)
        return self.client._request("wait", **f)

    def status(self):
        return self.client._request("status", handle=self.id)

    def cancel(self):
        """Cancel; answers once the operation has retired."""
        return self.client._request("cancel", handle=self.id)

    def result(self, timeout=None):
        """Wait; raise RcpError unless the operation is done."""
        s = self.wait(timeout)
        if s.get("state") == "done":
            return s
        e = s.get("failure") or {"reason": "other", "message": s.get("state")}
        raise RcpError(e["reason"], e["message"])

    def __repr__(self):
        return f"Handle({self.id})"


def _memfd(size, huge):
    """A sealed memfd of `size` bytes and its mapping; huge: True, False or
    'auto' (huge pages when size is a multiple of 2 MiB and there are
    pages for it)."""
    tries = []
    if huge is True or (huge == "auto" and size % HUGE_PAGE == 0):
        tries.append(True)
    if huge is not True:
        tries.append(False)
    err = None
    for h in tries:
        flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
        if h:
            flags |= os.MFD_HUGETLB
        try:
            fd = os.memfd_create("rcp-buffer", flags)
        except OSError as e:
            err = e
            continue
        try:
            os.ftruncate(fd, size)
            # No shrinking: rcpd refuses a buffer that could be truncated
            # under its mapping.
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            return fd, mm, h
        except OSError as e:
            os.close(fd)
            err = e
    raise err


class Client:
    """A connection to rcpd's unix socket. Everything registered over it
    lives as long as it does (or until released)."""

    def __init__(self, path=None, token=None, name=None, done_events=True):
        self.path = path or os.environ.get("RCP_SOCKET") or DEFAULT_SOCKET
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(self.path)
        self._sock.sendall(MAGIC)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._next = 0
        self._pending = {}
        # SimpleQueue: a C queue, no Condition per put and get (the owner of
        # a busy exposure takes an event per peer operation).
        self._events = queue.SimpleQueue()
        self._closed = None
        # What was read of rcpd's socket and not yet dispatched:
        # room[start:end], touched only by the thread that reads (below).
        self._room = bytearray(READ_CHUNK)
        self._start = self._end = 0
        # One thread at a time reads the socket (`_leading`, under _lock).
        # Until events can come (an exposure, `done` events, next_event),
        # that is a caller waiting for its reply, which dispatches the
        # others' and hands the socket to one still waiting when its own
        # has come: no thread woken to read a reply and wake its caller.
        # After, a reader thread reads from then on.
        self._leading = False
        self._reader = None
        self._reader_turn = threading.Lock()
        self._reader_turn.acquire()
        if done_events:
            self._start_reader()
        token = token if token is not None else os.environ.get("RCP_TOKEN")
        hello = {"version": VERSION, "name": name or f"pid {os.getpid()}"}
        if not done_events:
            # Operations' ends come from wait()/wait_all() only: no `done`
            # event per operation to parse, or to pile up unread.
            hello["done_events"] = False
        if token:
            hello["token"] = token
        self.hello = self._request("hello", **hello)

    @property
    def node(self):
        """The address peers dial this rcpd at (hello's `node`, HOST:PORT):
        what a service on another node passes as `peer` to reach buffers
        exposed here."""
        return self.hello.get("node", "")

    # -- framing ---------------------------------------------------------

    def _start_reader(self):
        # From now on a reader thread reads, whether a caller waits or
        # not: events may come at any time. It waits for its turn when a
        # caller reads at the moment (that one hands the socket to it).
        with self._lock:
            if self._reader is not None:
                return
            now = not self._leading
            self._leading = True
            self._reader = threading.Thread(target=self._read_loop, args=(now,), daemon=True)
        self._reader.start()

    def _read_loop(self, now):
        if not now:
            self._reader_turn.acquire()
        try:
            while True:
                self._read_some()
        except (EOFError, OSError, ValueError) as e:
            self._ended(e)

    def _read_some(self):
        # One recv takes whatever rcpd has sent (it coalesces a batch's
        # replies and events into one send); every whole frame in it is
        # dispatched before the next recv, not two recvs per frame.
        # Reads land in one reused room (a fresh bytes object per recv was
        # an mmap, mremap and munmap each); room[start:end] is unread.
        room, start, end = self._room, self._start, self._end
        if end == len(room):
            # Full: move the unread part to the front, or grow for a
            # frame larger than the room.
            grow = len(room) if start == 0 else 0
            room = room[start:end] + bytearray(len(room) - (end - start) + grow)
            start, end = 0, end - start
            self._room, self._start, self._end = room, start, end
        n = self._sock.recv_into(memoryview(room)[end:])
        if not n:
            raise EOFError("rcpd closed the connection")
        end += n
        self._end = end
        while end - start >= 4:
            (n,) = _LEN.unpack_from(room, start)
            if end - start - 4 < n:
                break
            # Dispatched, then passed: a KeyboardInterrupt between the two
            # (in a caller that reads) hands a reply over twice, which
            # the second time finds no caller, never none.
            self._dispatch(json.loads(room[start + 4 : start + 4 + n]))
            start += 4 + n
            self._start = start
        if start == end:
            self._start = self._end = 0

    def _ended(self, e):
        self._closed = e
        with self._lock:
            pending, self._pending = self._pending, {}
        for slot in pending.values():
            slot[1] = None
            slot[0].release()
        self._events.put(None)

    def _reply(self, slot):
        # A caller's wait for its reply: it reads the socket itself when
        # nobody does, else waits until the reader hands it its reply or,
        # when that reader is a caller whose own reply came, the socket.
        with self._lock:
            lead = not self._leading
            self._leading = True
        try:
            if not lead:
                slot[0].acquire()
                if slot[1] is not _TURN:
                    return slot[1]
                lead = True
                slot[1] = None
            while slot[1] is None and self._closed is None:
                self._read_some()
        except (EOFError, OSError, ValueError) as e:
            self._ended(e)
        except BaseException:
            # Interrupted (KeyboardInterrupt): no longer waiting, and the
            # socket, when this caller reads or was handed it meanwhile,
            # goes on to another.
            with self._lock:
                self._pending.pop(slot[2], None)
                lead = lead or slot[1] is _TURN
            raise
        finally:
            if lead:
                self._pass_on()
        return slot[1]

    def _pass_on(self):
        # The reading caller's reply came (or the socket ended): the
        # reader thread reads next when there is one; else a caller still
        # waiting, woken with _TURN; else nobody until the next request.
        with self._lock:
            if self._reader is not None:
                self._reader_turn.release()
                return
            for slot in self._pending.values():
                if slot[1] is None:
                    slot[1] = _TURN
                    slot[0].release()
                    return
            self._leading = False

    def _dispatch(self, msg):
        if "re" in msg:
            with self._lock:
                slot = self._pending.pop(msg["re"], None)
            if slot is not None:
                slot[1] = msg
                slot[0].release()
        elif "event" in msg:
            self._events.put(msg)

    def _request(self, op, _fds=(), **fields):
        with self._lock:
            if self._closed is not None:
                raise RcpError("retryable", f"connection to rcpd closed: {self._closed}")
            self._next += 1
            rid = self._next
            # A lock held until the reader hands the reply over (lighter
            # than an Event: no Condition, no waiter list).
            done = threading.Lock()
            done.acquire()
            slot = [done, None, rid]
            self._pending[rid] = slot
        try:
            body = json.dumps(dict(fields, id=rid, op=op)).encode()
            frame = struct.pack("<I", len(body)) + body
            with self._send_lock:
                if _fds:
                    sent = socket.send_fds(self._sock, [frame], list(_fds))
                    if sent < len(frame):
                        self._sock.sendall(frame[sent:])
                else:
                    self._sock.sendall(frame)
        except ConnectionError as e:
            # rcpd went away (found here first when nobody reads while
            # the client is idle): the connection ends for every caller.
            self._ended(e)
            raise RcpError("retryable", f"connection to rcpd closed: {e}") from None
        except BaseException:
            with self._lock:
                self._pending.pop(rid, None)
            raise
        msg = self._reply(slot)
        if msg is None:
            raise RcpError("retryable", f"connection to rcpd closed: {self._closed}")
        if "error" in msg:
            e = msg["error"]
            raise RcpError(e.get("reason", "other"), e.get("message", ""))
        msg.pop("re", None)
        return msg

    # -- buffers ---------------------------------------------------------

    def create_buffer(self, size, huge="auto"):
        """A new buffer of `size` bytes: a memfd (MFD_HUGETLB where huge
        pages are configured and `size` is a multiple of 2 MiB), sealed
        against shrinking, mapped here, handed to rcpd (SCM_RIGHTS)."""
        fd, mm, h = _memfd(size, huge)
        try:
            r = self._request("register", _fds=[fd], size=size)
        finally:
            os.close(fd)
        return Buffer(self, r["buffer"], size, mm, h)

    def register_fd(self, fd, size):
        """Hand rcpd an fd you made yourself (it must be a memfd sealed with
        F_SEAL_SHRINK); the buffer id."""
        return self._request("register", _fds=[fd], size=size)["buffer"]

    def release(self, buf):
        bid = buf.id if isinstance(buf, Buffer) else buf
        return self._request("release", buffer=bid)

    def expose(
        self, buf, name, offset=0, length=None, access="rw", peers=None, grant="per-op"
    ):
        """Make [offset, offset+length) of `buf` reachable from other
        rcpds as `name`: access 'read', 'write' or 'rw'; peers: IP
        addresses of the rcpds allowed (None: any); grant: 'per-op' (a
        grant per operation, revoked at its end) or 'standing' (each
        peer's session is granted the whole range once, until unexpose,
        this connection's end or the session's: its operations need no
        grant each)."""
        # Its events may come at any time from now on: read them as they do.
        self._start_reader()
        f = {"buffer": buf.id, "name": name, "offset": offset, "access": access}
        if length is not None:
            f["len"] = length
        if peers:
            f["peers"] = list(peers)
        if grant != "per-op":
            f["grant"] = grant
        return self._request("expose", **f)

    def unexpose(self, name):
        return self._request("unexpose", name=name)

    @staticmethod
    def _op_fields(buf, peer, name, descs, message=None, check=None):
        f = {
            "buffer": buf.id,
            "peer": peer,
            "name": name,
            "descs": [[int(a), int(b), int(c)] for a, b, c in descs],
        }
        if message:
            f["message"] = message
        if check:
            f["check"] = check
        return f

    def _op(self, op, buf, peer, name, descs, message, check):
        f = self._op_fields(buf, peer, name, descs, message, check)
        return Handle(self, self._request(op, **f)["handle"])

    def _many(self, op, ops, wait, timeout):
        fields = []
        for o in ops:
            if isinstance(o, dict):
                fields.append(self._op_fields(**o))
            else:
                fields.append(self._op_fields(*o))
        return self._started(op, {"ops": fields}, wait, timeout)

    def _started(self, op, f, wait, timeout):
        if wait:
            f["wait"] = True
            if timeout is not None:
                f["timeout_ms"] = int(timeout * 1000)
        elif timeout is not None:
            raise ValueError("timeout goes with wait=True")
        r = self._request(op, **f)
        if not wait:
            return [Handle(self, h) for h in r["handles"]]
        if "statuses" not in r:
            raise RcpError("version", f"rcpd answered {op} without statuses: it does not know wait (older)")
        return r["statuses"]

    def write_many(self, ops, wait=False, timeout=None):
        """Start several writes in one request: each op is shaped as
        write()'s arguments, a tuple (buf, peer, name, descs[, message[,
        check]]) or a dict of them. rcpd checks every op before it starts
        any (one that cannot start raises RcpError naming it, and none
        starts); a list of Handles in their order. With wait=True, the
        same request also waits for them (within `timeout` seconds for
        all), as wait_all() would: a list of their states in order, each
        with its `handle`; a batch in one request instead of two."""
        return self._many("write_many", ops, wait, timeout)

    def read_many(self, ops, wait=False, timeout=None):
        """write_many() of reads."""
        return self._many("read_many", ops, wait, timeout)

    def write_each(self, buf, peer, name, descs, message=None, check=None, wait=False, timeout=None):
        """write_many() of one prepared list: each (local offset, remote
        offset, length) of `descs` is a write of its own, all from `buf`
        into `peer`'s `name`, with one `message` and `check`. One request,
        and less to say than a list of ops; a list of Handles in the order
        of `descs` (with wait=True, their states: write_many())."""
        return self._each("write_many", buf, peer, name, descs, message, check, wait, timeout)

    def read_each(self, buf, peer, name, descs, message=None, check=None, wait=False, timeout=None):
        """write_each() of reads."""
        return self._each("read_many", buf, peer, name, descs, message, check, wait, timeout)

    def _each(self, op, buf, peer, name, descs, message, check, wait, timeout):
        f = self._op_fields(buf, peer, name, descs, message, check)
        return self._started(op, {"each": f}, wait, timeout)

    def wait_all(self, handles, timeout=None):
        """Wait for each of `handles` in one request (within `timeout`
        seconds for all): a list of their states, as Handle.wait() gives
        them, in their order."""
        f = {"handles": [h.id if isinstance(h, Handle) else int(h) for h in handles]}
        if timeout is not None:
            f["timeout_ms"] = int(timeout * 1000)
        return self._request("wait_all", **f)["statuses"]

    def write(self, buf, peer, name, descs, message=None, check=None):
        """Write ranges of `buf` into `peer`'s buffer `name`: descs is a
        list of (local offset, remote offset, length). `check`: "blake3",
        "sha256", "xxh3" or "none", named exactly (rcpd refuses another,
        "BLAKE3" too: RcpError "invalid" listing them); None: rcpd's
        default. A Handle."""
        return self._op("write", buf, peer, name, descs, message, check)

    def read(self, buf, peer, name, descs, message=None, check=None):
        """Read ranges of `peer`'s buffer `name` into `buf`."""
        return self._op("read", buf, peer, name, descs, message, check)

    def next_event(self, timeout=None):
        """The next event (`written` / `read` on our exposures, `done` of
        our operations), or None after `timeout` seconds or when the
        connection closed."""
        self._start_reader()
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            return None

    def events(self, timeout=None):
        """Events until none comes for `timeout` seconds."""
        while True:
            ev = self.next_event(timeout)
            if ev is None:
                return
            yield ev

    def close(self):
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()

    # -- the Copy API (gRPC on the same socket) --------------------------

    def copy(self, direction, local_path, remote, remote_path, recursive=False,
             preserve=False, resume=False, remote_token="", transport="", block_size=0,
             token=None, checks=(), fanout=()):
        """Ask rcpd to copy one of its paths to ('push') or from ('pull')
        another rcpd. Yields progress dicts; the last has done=True.
        `checks`: the block checks rcpd offers the other one, preferred
        first ('blake3', 'sha256', 'xxh3', 'none'; empty: rcpd's default,
        blake3 then sha256). `fanout`: a push goes on from `remote` along
        these rcpds ("host:port"), each forwarding what it verified to the
        next (docs/fanout.md); the last progress's `nodes` lists every
        node's result (node, done, unreachable, error). Needs grpcio."""
        from . import _copy
        return _copy.copy(self.path, token if token is not None else os.environ.get("RCP_TOKEN"),
                          direction, local_path, remote, remote_path, recursive, preserve,
                          resume, remote_token, transport, block_size, checks, fanout)


def connect(path=None, token=None, name=None, done_events=True):
    """Connect to rcpd's socket: `path`, else $RCP_SOCKET, else
    /run/rcp/rcpd.sock. done_events=False: rcpd sends no `done` event for
    this connection's operations (their ends come from wait/wait_all; the
    events of the exposures, `written` and `read`, still come)."""
    return Client(path, token, name, done_events)
