"""A stand-in for a vLLM server (or the proxy) in launcher tests: answers GET /health, nothing else.

    python fake_server.py --port P [--pid-dir D] [--exit-code C --exit-after-s S]

Writes its pid to D/<port>.<pid> at start (so a test can see restarts), exits with C after S
seconds when asked to; otherwise serves until killed. Ignores every other argument (it is given
vLLM's command line).
"""

from __future__ import annotations

import argparse
import http.server
import os
import sys
import threading
from pathlib import Path


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *_args: object) -> None:
        pass


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--pid-dir", type=Path, default=None)
    p.add_argument("--exit-code", type=int, default=None)
    p.add_argument("--exit-after-s", type=float, default=0.0)
    args, _ = p.parse_known_args()
    if args.pid_dir is not None:
        (args.pid_dir / f"{args.port}.{os.getpid()}").touch()
    print(f"fake server pid {os.getpid()} on port {args.port}", flush=True)
    if args.exit_code is not None:
        threading.Timer(args.exit_after_s, lambda: os._exit(args.exit_code)).start()
    server = http.server.HTTPServer(("127.0.0.1", args.port), Health)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
