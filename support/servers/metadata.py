"""A local instance-metadata service on 127.0.0.1 that answers as AWS, GCP and Azure document it, for
the preemption-notice sources (tasks/core/config/notices.py) in the tests.

    python -m support.servers.metadata          # prints its URL; `preempt` on stdin schedules the notice

What it serves (the documented requests, headers checked, the documented answers):

- AWS (IMDSv2): `PUT /latest/api/token` with `X-aws-ec2-metadata-token-ttl-seconds` -> a token;
  `GET /latest/meta-data/spot/instance-action` with that `X-aws-ec2-metadata-token` -> 404 until
  preempted, then `{"action": "terminate", "time": "<now + 2 min, ISO 8601>"}`; 401 without a valid token.
- GCP: `GET /computeMetadata/v1/instance/preempted` with `Metadata-Flavor: Google` -> FALSE, then
  TRUE; 403 without the header.
- Azure: `GET /metadata/scheduledevents?api-version=...` with `Metadata: true` -> `{"DocumentIncarnation":
  n, "Events": []}`, then one `Preempt` event; 400 without the header.

`preempt()` flips all three at once; `requests` records what was asked (method, path, headers in lower case).
`trickle_s` > 0 makes every answer, status line and headers included, come one byte every `trickle_s`
seconds (a metadata service that is alive but too slow to be of use).
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler
from typing import Any

from support.servers import LocalHTTPServer


class MetadataServer(LocalHTTPServer):
    def __init__(self) -> None:
        self.preempted = False
        self.trickle_s = 0.0
        self.requests: list[dict[str, Any]] = []
        self._tokens: set[str] = set()
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, status: int, body: str, ctype: str = "text/plain") -> None:
                data = body.encode()
                if server.trickle_s > 0:
                    return self._trickle(status, data, ctype)
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _trickle(self, status: int, data: bytes, ctype: str) -> None:
                head = f"HTTP/1.1 {status} {self.responses.get(status, ('',))[0]}\r\nContent-Type: {ctype}\r\n"
                raw = (head + f"Content-Length: {len(data)}\r\n\r\n").encode() + data
                self.close_connection = True
                for i in range(len(raw)):
                    try:
                        self.wfile.write(raw[i : i + 1])
                    except OSError:  # the client gave up (its deadline): nothing more to send
                        return
                    time.sleep(server.trickle_s)

            def _record(self) -> None:
                with server._lock:
                    server.requests.append(
                        {
                            "method": self.command,
                            "path": self.path,
                            "headers": {k.lower(): v for k, v in self.headers.items()},
                        }
                    )

            def do_PUT(self) -> None:
                self._record()
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path != "/latest/api/token":
                    return self._answer(404, "Not Found")
                if not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    return self._answer(400, "Missing or Invalid Parameters")
                token = uuid.uuid4().hex
                with server._lock:
                    server._tokens.add(token)
                self._answer(200, token)

            def do_GET(self) -> None:
                self._record()
                path = self.path.split("?", 1)[0]
                if path == "/latest/meta-data/spot/instance-action":
                    if self.headers.get("X-aws-ec2-metadata-token") not in server._tokens:
                        return self._answer(401, "Unauthorized")
                    if not server.preempted:
                        return self._answer(404, "Not Found")
                    when = dt.datetime.now(dt.UTC) + dt.timedelta(minutes=2)
                    body = {"action": "terminate", "time": when.strftime("%Y-%m-%dT%H:%M:%SZ")}
                    return self._answer(200, json.dumps(body), "application/json")
                if path == "/computeMetadata/v1/instance/preempted":
                    if self.headers.get("Metadata-Flavor") != "Google":
                        return self._answer(403, "Missing Metadata-Flavor:Google header.")
                    return self._answer(200, "TRUE" if server.preempted else "FALSE")
                if path == "/metadata/scheduledevents":
                    if self.headers.get("Metadata") != "true":
                        return self._answer(
                            400, json.dumps({"error": "Bad request. Required metadata header not specified"})
                        )
                    events = []
                    if server.preempted:
                        not_before = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=30)
                        events.append(
                            {
                                "EventId": "602d9444-d2cd-49c7-8624-8643e7171297",
                                "EventType": "Preempt",
                                "ResourceType": "VirtualMachine",
                                "Resources": ["spot-vm-0"],
                                "EventStatus": "Scheduled",
                                "NotBefore": not_before.strftime("%a, %d %b %Y %H:%M:%S GMT"),
                                "Description": "",
                                "EventSource": "Platform",
                                "DurationInSeconds": -1,
                            }
                        )
                    body = {"DocumentIncarnation": 2 if server.preempted else 1, "Events": events}
                    return self._answer(200, json.dumps(body), "application/json")
                self._answer(404, "Not Found")

            def log_message(self, *args: Any) -> None:
                pass

        self._serve(Handler, "metadata-double")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def preempt(self) -> None:
        self.preempted = True


if __name__ == "__main__":
    with MetadataServer() as m:
        print(m.url, flush=True)
        for line in sys.stdin:
            if line.strip() == "preempt":
                m.preempt()
                print("preempted", flush=True)
