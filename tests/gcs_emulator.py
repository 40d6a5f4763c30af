"""A GCS emulator for the tests: ``python gcs_emulator.py PORT BUCKET``.

gcp-storage-emulator (a test dependency) with what tensorstore needs of it and it lacks:
- the preconditions ``ifGenerationMatch`` and ``ifGenerationNotMatch`` of reads, writes and
  deletes (412 when one fails, 304 for a read whose object is unchanged): orbax's OCDBT
  checkpoints update their manifest with them, and without them two writers overwrite each
  other's;
- ``moveTo``, with which gcsfs renames an object (it retries for minutes without it);
- a listen backlog for tensorstore's many connections (http.server's default of 5 resets
  some): the emulator serves one request at a time.
"""

import http.server
import json
import re
import sys
from urllib.parse import parse_qs, unquote, urlparse

from gcp_storage_emulator import server
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects


def _object(path: str, query: dict) -> tuple[str, str] | None:
    """(bucket, object) of a JSON API request to an object, None if it names none."""
    parts = path.split("/b/", 1)[1].split("/") if "/b/" in path else []
    if len(parts) >= 3 and parts[1] == "o":  # .../b/<bucket>/o/<object>
        return parts[0], unquote("/".join(parts[2:]))
    if len(parts) == 2 and parts[1] == "o" and "name" in query:  # an upload
        return parts[0], query["name"][0]
    return None


def _refused(handler, method) -> bool:
    """Answers 412 or 304 (and returns True) where a precondition of the request fails."""
    url = urlparse(handler.path)
    query = parse_qs(url.query)
    match, not_match = query.get("ifGenerationMatch"), query.get("ifGenerationNotMatch")
    named = _object(url.path, query)
    if not (match or not_match) or named is None:
        return False
    try:
        generation = str(handler.storage.get_file_obj(*named)["generation"])
    except NotFound:
        generation = "0"
    if match and match[0] != generation:
        status = 412
    elif not_match and not_match[0] == generation:
        status = 304 if method == "GET" else 412
    else:
        return False
    length = int(handler.headers.get("Content-Length") or 0)
    handler.rfile.read(length)  # the body of a refused upload
    handler.send_response(status)
    handler.send_header("Content-Length", "0")
    handler.end_headers()
    return True


def _moved(handler, method) -> bool:
    """Answers a ``moveTo`` (and returns True): a copy, then the source deleted."""
    move = re.fullmatch(r".*/b/([^/]+)/o/(.+)/moveTo/o/([^?]+)", urlparse(handler.path).path)
    if method != "POST" or move is None:
        return False
    bucket, source, target = move[1], unquote(move[2]), unquote(move[3])
    handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
    try:
        moved = objects._copy(f"http://{handler.headers.get('Host')}", handler.storage, bucket,
                              source, bucket, target)
        handler.storage.delete_file(bucket, source)
        status, body = 200, json.dumps(moved).encode()
    except NotFound:
        status, body = 404, b""
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)
    return True


def _with_preconditions(method):
    def do(handler):
        if not (_refused(handler, method) or _moved(handler, method)):
            server.Router(handler).handle(method)
    return do


for _method in ("GET", "POST", "PUT", "PATCH", "DELETE"):
    setattr(server.RequestHandler, f"do_{_method}", _with_preconditions(_method))
http.server.HTTPServer.request_queue_size = 256

if __name__ == "__main__":
    port, bucket = int(sys.argv[1]), sys.argv[2]
    server.create_server("localhost", port, in_memory=True, default_bucket=bucket).run()
