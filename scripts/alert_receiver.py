"""A stand-in for a chat webhook while you try Kiln's alerts: prints the text of every JSON body posted
to it (what Slack would show), one alert a paragraph, on 127.0.0.1.

    python scripts/alert_receiver.py 9000 &
    kiln deploy --alert-webhook http://127.0.0.1:9000/alerts
"""

from __future__ import annotations

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Receiver(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        print(body.get("text", body), end="\n\n", flush=True)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args) -> None:  # the alerts, not the access log
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("port", type=int)
    ThreadingHTTPServer(("127.0.0.1", parser.parse_args().port), Receiver).serve_forever()


if __name__ == "__main__":
    main()
