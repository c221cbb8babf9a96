"""Wait until an HTTP endpoint answers 200 (or until it stops answering), then optionally exec a command: the
order between the containers of one pod, which Kubernetes 1.27 cannot state in the pod spec itself.

    python -m lmcache_p2p.cli.http_wait --url http://127.0.0.1:7601/healthcheck --timeout-s 600 -- vllm serve ...
    python -m lmcache_p2p.cli.http_wait --url http://$POD_IP:7100/health --until down --timeout-s 150
    python -m lmcache_p2p.cli.http_wait --url http://127.0.0.1:7601/healthcheck --timeout-s 0    # one probe

A pod of LMCache's multi-process recipe starts vLLM behind the first form (its LMCache server must listen
before vLLM's connector registers with it), stops the server after the second (it must outlive vLLM's drain),
and probes the server with the third (it listens on loopback, where a kubelet's httpGet does not reach).
Only the standard library: a probe every few seconds must start fast, and the wait must not import what the
command it execs imports.
"""

from __future__ import annotations

import argparse
import enum
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence

ATTEMPT_TIMEOUT_S = 2.0  # one request's limit
EVERY_S = 1.0  # between attempts
DOWN_AFTER_SILENT = 3  # --until down: attempts in a row with no answer in time that count as down


class Until(str, enum.Enum):
    UP = "up"  # the endpoint answers 200
    DOWN = "down"  # the endpoint no longer answers 200: refused, an error status, or DOWN_AFTER_SILENT silences


class Answer(enum.Enum):
    OK = "ok"  # 200
    NOT_OK = "not ok"  # a refused connection, an error status, a bad URL
    SILENT = "silent"  # no answer within the attempt's limit: a busy server, or a stuck one


def probe(url: str, timeout_s: float = ATTEMPT_TIMEOUT_S) -> Answer:
    """One attempt at ``url`` (no proxy from the environment: the pod's own)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout_s) as resp:
            return Answer.OK if resp.status == 200 else Answer.NOT_OK
    except urllib.error.HTTPError:  # an error status (a URLError too)
        return Answer.NOT_OK
    except urllib.error.URLError as exc:
        return Answer.SILENT if isinstance(exc.reason, TimeoutError) else Answer.NOT_OK
    except TimeoutError:  # the answer did not come in time
        return Answer.SILENT
    except (OSError, ValueError):
        return Answer.NOT_OK


def answers(url: str, timeout_s: float = ATTEMPT_TIMEOUT_S) -> bool:
    """Whether ``url`` answers 200 within ``timeout_s``."""
    return probe(url, timeout_s) is Answer.OK


def wait(url: str, until: Until, timeout_s: float, every_s: float = EVERY_S,
         probe: Callable[[str], Answer] = probe) -> bool:
    """Whether ``url`` reached ``until`` within ``timeout_s`` (at least one attempt, one every ``every_s``).
    Down is a refused connection or an error status at once, but no answer in time only when it repeats:
    a draining server that answers its health check late is still up."""
    deadline = time.monotonic() + timeout_s
    silent = 0
    while True:
        answer = probe(url)
        silent = silent + 1 if answer is Answer.SILENT else 0
        if until is Until.UP and answer is Answer.OK:
            return True
        if until is Until.DOWN and (answer is Answer.NOT_OK or silent >= DOWN_AFTER_SILENT):
            return True
        if time.monotonic() + every_s > deadline:
            return False
        time.sleep(every_s)


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    argv = list(argv)
    at = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(prog="python -m lmcache_p2p.cli.http_wait", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="the endpoint (200 = up)")
    p.add_argument("--until", choices=[u.value for u in Until], default=Until.UP.value,
                   help="up: until it answers 200; down: until it no longer does (default %(default)s)")
    p.add_argument("--timeout-s", type=float, required=True, help="how long to wait (0: one attempt)")
    p.add_argument("--what", default="the endpoint", help="what the error message calls it")
    p.add_argument("--timeout-flag", default="--timeout-s", help="the setting the error message names")
    return p.parse_args(argv[:at]), argv[at + 1:]


def main(argv: Sequence[str] | None = None, execvp: Callable[[str, list[str]], object] = os.execvp) -> int:
    """0 once reached (after exec'ing the command, if any, it does not return); 1 if not in time."""
    args, command = parse_args(sys.argv[1:] if argv is None else argv)
    until = Until(args.until)
    if args.timeout_s < 0:
        print(f"http_wait: --timeout-s must be >= 0, got {args.timeout_s:g}", file=sys.stderr)
        return 2
    if not wait(args.url, until, args.timeout_s):
        state = "answer 200" if until is Until.UP else "stop answering"
        print(f"http_wait: {args.what} at {args.url} did not {state} within {args.timeout_s:g} s: see its log, or "
              f"raise {args.timeout_flag}", file=sys.stderr)
        return 1
    if command:
        sys.stdout.flush()
        execvp(command[0], command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
