"""One chat completion with the real openai SDK, and what it saw, as one JSON line.

    python openai_chat.py BASE_URL SPEC

SPEC is JSON: {"stream": bool, "include_usage": bool, "max_tokens": int, "headers": {...}}.
"headers" go with the request (the stub's x-stub-* knobs, or "Accept-Encoding: identity" to
turn gzip off; the SDK asks for gzip by default).

The SDK parses the answer as usual. A transport under it keeps the bytes that crossed the
wire: the request body as sent, and the response body as received, before any
content-decoding. Printed: status, response headers, "raw", "decoded" (raw without its gzip)
and "request_body" (hex), the usage and content as the SDK read them, the number of stream
chunks it yielded, and "error" (class and message) when the SDK raised.
"""

import json
import sys
import zlib

import openai

# The HTTP library the SDK is built on: httpx2 from openai 3, httpx before.
try:
    import httpx2 as http
except ImportError:
    import httpx as http


class Tee(http.BaseTransport):
    """An HTTP transport that keeps what went over the wire."""

    def __init__(self):
        self.inner = http.HTTPTransport()
        self.request_body = b""
        self.raw = bytearray()
        self.status = None
        self.headers = {}

    def handle_request(self, request):
        self.request_body = request.read()
        response = self.inner.handle_request(request)
        self.status = response.status_code
        self.headers = {k.lower(): v for k, v in response.headers.items()}
        upstream, raw = response.stream, self.raw

        class Stream(http.SyncByteStream):
            def __iter__(self):
                for chunk in upstream:
                    raw.extend(chunk)
                    yield chunk

            def close(self):
                upstream.close()

        response.stream = Stream()
        return response

    def close(self):
        self.inner.close()


def main():
    base_url, spec = sys.argv[1], json.loads(sys.argv[2])
    tee = Tee()
    client = openai.OpenAI(
        base_url=base_url,
        api_key=spec.get("api_key", "sk-test"),
        max_retries=0,
        timeout=30,
        http_client=http.Client(transport=tee),
    )
    args = dict(
        model="gpt-4o-mini",
        messages=[{"role": "user", "content": spec.get("prompt", "Say hello.")}],
        max_tokens=spec.get("max_tokens", 16),
        extra_headers=spec.get("headers", {}),
    )
    out = {"usage": None, "content": "", "chunks": 0, "error": None}
    try:
        if spec.get("stream"):
            if spec.get("include_usage"):
                args["stream_options"] = {"include_usage": True}
            for chunk in client.chat.completions.create(stream=True, **args):
                out["chunks"] += 1
                if chunk.usage is not None:
                    out["usage"] = chunk.usage.model_dump()
                for choice in chunk.choices:
                    out["content"] += choice.delta.content or ""
        else:
            completion = client.chat.completions.create(**args)
            out["usage"] = completion.usage.model_dump() if completion.usage else None
            out["content"] = completion.choices[0].message.content
    except Exception as e:  # the test asserts on which one
        out["error"] = {"class": type(e).__name__, "message": str(e)}
    out["status"] = tee.status
    out["headers"] = tee.headers
    out["raw"] = bytes(tee.raw).hex()
    # What the SDK decoded from it; a cut gzip stream decodes as far as it goes.
    decoded = bytes(tee.raw)
    if tee.headers.get("content-encoding") == "gzip":
        decoded = zlib.decompressobj(wbits=31).decompress(decoded)
    out["decoded"] = decoded.hex()
    out["request_body"] = tee.request_body.hex()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
