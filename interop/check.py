#!/usr/bin/env python3
"""Interoperability check: hooklatch against each provider's official library.

    python interop/check.py PATH/TO/hooklatch

Needs a Python with interop/requirements.txt installed. Proves, in both directions:

(a) deliveries signed with the provider's official library (or, where the provider has no
    Python library, a reference signer checked against the provider's published test vector)
    are accepted by a running `hooklatch serve`, and the same deliveries tampered with (body
    changed after signing, wrong secret, stale timestamp, missing signature, badly encoded
    signature) are refused with 401 and the right `code` -- and the official verifier refuses
    each of those too, so the two agree on every case;
(b) every test event `hooklatch send` produces (`hooklatch send --list`) verifies with the
    official library, captured by a one-request HTTP server in this script.

Writes its own config (the sources of examples/providers.toml, with its own store, ports and
a few extra sources for published test vectors) into a temporary directory, starts the
gateway, waits for GET /readyz on the admin port, runs every case, and always stops the
gateway. Only 127.0.0.1 is used; every request has a timeout.

Prints one line per case, `PASS|FAIL provider case detail`, then `N passed, M failed`, and
exits non-zero on any failure.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import http.client
import http.server
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

# The official libraries (PyPI; versions pinned in interop/requirements.txt).
import razorpay
import stripe
from nacl.signing import SigningKey, VerifyKey
from paddle_billing.Notifications import PaddleSignature
from paddle_billing.Notifications import Secret as PaddleSecret
from paddle_billing.Notifications import Verifier as PaddleVerifier
from slack_sdk.signature import SignatureVerifier
from standardwebhooks.webhooks import Webhook as StandardWebhook
from twilio.request_validator import RequestValidator, remove_port

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_CONFIG = ROOT / "examples" / "providers.toml"
FIXTURES = ROOT / "crates" / "hooklatch" / "fixtures"

HTTP_TIMEOUT = 10  # seconds, every request
SEND_TIMEOUT = 30  # seconds, one `hooklatch send`
READY_TIMEOUT = 60  # seconds, the gateway's start-up
STALE = 600  # seconds in the past: outside the default 300 s tolerance
ADMIN_TOKEN = "interop-admin-token-0123456789"

# Discord: RFC 8032 section 7.1 test 1's private key seed; examples/providers.toml configures
# its public key, and `hooklatch send discord --secret` takes the seed.
DISCORD_SEED_HEX = "9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60"

# Published test vectors (from /work/shared/providers.md), for the providers that publish no
# official Python library: GitHub, Shopify, WhatsApp (Meta).
GITHUB_DOCS_VECTOR = (  # GitHub docs, "Testing the webhook payload validation"
    "It's a Secret to Everybody",
    b"Hello, World!",
    "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17",
)
GITHUB_OCTOKIT_VECTOR = (  # octokit/webhooks-methods.js test/sign.test.ts
    "mysecret",
    b'{"foo":"bar"}',
    "sha256=4864d2759938a15468b5df9ade20bf161da9b4f737ea61794142f3484236bda3",
)
SHOPIFY_VECTOR = (  # Shopify/shopify-app-js validate.test.ts (secret from test-config.ts)
    "test_secret_key",
    b'{"foo": "bar"}',
    "B23tXN681gZ0qIWNRrgtzBE9XSDo5yaUu6wfmhu3a7g=",
)

# A Standard Webhooks secret written without base64 padding (32 key bytes: 43 characters
# where padded base64 has 44). standardwebhooks' Python library pads before decoding.
UNPADDED_WHSEC = "whsec_" + base64.b64encode(hashlib.sha256(b"hooklatch interop").digest()).decode().rstrip(
    "="
)

# Extra sources, one per vector, each configured with only the vector's secret.
VECTOR_SOURCES = [
    {"name": "svix-unpadded", "provider": "standard-webhooks", "secret": UNPADDED_WHSEC},
    {"name": "github-vector-docs", "provider": "github", "secret": GITHUB_DOCS_VECTOR[0]},
    {"name": "github-vector-octokit", "provider": "github", "secret": GITHUB_OCTOKIT_VECTOR[0]},
    {"name": "shopify-vector", "provider": "shopify", "secret": SHOPIFY_VECTOR[0]},
    # Meta publishes no vector; X-Hub-Signature-256 is GitHub's scheme, so GitHub's JSON one.
    {"name": "whatsapp-vector", "provider": "whatsapp", "secret": GITHUB_OCTOKIT_VECTOR[0]},
]


class Failure(Exception):
    """A case's expectation did not hold."""


# ----------------------------------------------------------------------------- plumbing


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> dict:
        try:
            return json.loads(self.body)
        except ValueError as err:
            raise Failure(f"{self.status}, body is not JSON: {self.body[:200]!r}") from err


def request(port: int, method: str, target: str, body: bytes | None, headers: dict) -> Response:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HTTP_TIMEOUT)
    try:
        conn.request(method, target, body=body, headers=headers)
        res = conn.getresponse()
        data = res.read()
        return Response(res.status, {k.lower(): v for k, v in res.getheaders()}, data)
    finally:
        conn.close()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Captured:
    url: str
    headers: dict[str, str]  # names lowercased
    body: bytes


class CaptureServer:
    """Answers every POST with 200 and hands each request over through a queue. Also used as
    the gateway's delivery destination (a sink), where nobody reads the queue."""

    def __init__(self, keep: bool):
        self.requests: queue.Queue[Captured] = queue.Queue()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's naming)
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length)
                if keep:
                    outer.requests.put(
                        Captured(
                            url=f"http://{self.headers.get('host')}{self.path}",
                            headers={k.lower(): v for k, v in self.headers.items()},
                            body=body,
                        )
                    )
                reply = b'{"status":"captured"}'
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def take(self) -> Captured:
        try:
            return self.requests.get(timeout=HTTP_TIMEOUT)
        except queue.Empty as err:
            raise Failure("the capture server received nothing") from err

    def drain(self):
        while not self.requests.empty():
            self.requests.get_nowait()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML for {value!r}")


def to_toml(config: dict) -> str:
    lines = []
    for section in ("server", "store"):
        lines.append(f"[{section}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in config[section].items()]
        lines.append("")
    for table in ("sources", "destinations"):
        for item in config[table]:
            lines.append(f"[[{table}]]")
            lines += [f"{k} = {toml_value(v)}" for k, v in item.items()]
            lines.append("")
    return "\n".join(lines)


def fixture(provider: str, name: str, key: str, now: int) -> bytes:
    """A test event body from crates/hooklatch/fixtures, filled in as `hooklatch send` does."""
    path = FIXTURES / provider / name
    created = dt.datetime.fromtimestamp(now, tz=dt.timezone.utc).isoformat().replace("+00:00", "Z")
    text = path.read_text(encoding="utf-8")
    text = text.replace("{{id}}", key).replace("{{created_rfc3339}}", created)
    return text.replace("{{created}}", str(now)).encode()


def tamper(body: bytes) -> bytes:
    """The body changed after signing: one field injected (JSON object or form)."""
    stripped = body.lstrip()
    if stripped.startswith(b"{"):
        return b'{"injected":true,' + stripped[1:]
    return b"Injected=1&" + body


def hmac256(secret: str, data: bytes) -> bytes:
    return hmac.new(secret.encode(), data, hashlib.sha256).digest()


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def hex_to_b64(hex_text: str) -> str:
    """A hex digest re-encoded as base64: the right bytes in the wrong encoding."""
    return b64(bytes.fromhex(hex_text))


def fresh(prefix: str = "") -> str:
    return prefix + uuid.uuid4().hex


class MultiDict(dict):
    """Form parameters for twilio's RequestValidator, repeated names kept (it calls getall)."""

    @classmethod
    def parse(cls, body: bytes) -> "MultiDict":
        out = cls()
        for name, value in parse_qsl(body.decode(), keep_blank_values=True):
            out.setdefault(name, []).append(value)
        return out

    def getall(self, name):
        return self[name]


# ----------------------------------------------------------------------------- providers
#
# Each provider: `sign(body, secret, ts, **kw) -> headers` and `verify(body, headers, secret,
# **kw) -> bool`, with the official library where there is one.


class Provider:
    name = ""
    signature_header = ""
    signs_timestamp = False
    # Whether the library's verifier checks the timestamp (Discord's Ed25519 check does not).
    library_checks_time = True
    content_type = "application/json"
    library = ""  # what signs and verifies, for the report

    def sign(self, body: bytes, secret: str, ts: int, **kw) -> dict:
        raise NotImplementedError

    def verify(self, body: bytes, headers: dict, secret: str, **kw) -> bool:
        raise NotImplementedError

    def bad_encoding(self, headers: dict) -> tuple[str, str]:
        """The signature header re-encoded wrongly, and the code hooklatch gives it."""
        raise NotImplementedError

    def malformed(self, headers: dict) -> tuple[str, str] | None:
        """A structurally broken signature header, if the scheme has structure to break."""
        return None


def lower(headers: dict) -> dict:
    return {k.lower(): v for k, v in headers.items()}


class StripeP(Provider):
    name = "stripe"
    signature_header = "Stripe-Signature"
    signs_timestamp = True
    library = "stripe.WebhookSignature.generate_signature_header / stripe.Webhook.construct_event"

    def sign(self, body, secret, ts, **kw):
        header = stripe.WebhookSignature.generate_signature_header(body.decode(), secret, timestamp=ts)
        return {"Stripe-Signature": header, "Content-Type": self.content_type}

    def verify(self, body, headers, secret, **kw):
        try:
            stripe.Webhook.construct_event(body, lower(headers).get("stripe-signature"), secret)
            return True
        except stripe.SignatureVerificationError:
            return False

    def bad_encoding(self, headers):
        t, v1 = headers["Stripe-Signature"].split(",")
        # A `v1` that is not hex matches nothing (every `v1` is tried): invalid, not malformed.
        return f"{t},v1={hex_to_b64(v1.split('=', 1)[1])}", "invalid_signature"

    def malformed(self, headers):
        return headers["Stripe-Signature"].split(",", 1)[1], "malformed_signature"  # no `t=`


class StandardWebhooksP(Provider):
    name = "standard-webhooks"
    signature_header = "webhook-signature"
    signs_timestamp = True
    library = "standardwebhooks.Webhook.sign / Webhook.verify"

    def sign(self, body, secret, ts, msg_id=None, **kw):
        msg_id = msg_id or fresh("msg_")
        when = dt.datetime.fromtimestamp(ts, tz=dt.timezone.utc)
        signature = StandardWebhook(secret).sign(msg_id, when, body.decode())
        return {
            "webhook-id": msg_id,
            "webhook-timestamp": str(ts),
            "webhook-signature": signature,
            "Content-Type": self.content_type,
        }

    def verify(self, body, headers, secret, **kw):
        try:
            StandardWebhook(secret).verify(body, headers)
            return True
        except Exception:  # WebhookVerificationError, or a decoding error on bad input
            return False

    def bad_encoding(self, headers):
        raw = base64.b64decode(headers["webhook-signature"].split(",", 1)[1])
        # Hex text is valid base64 of other bytes: it decodes, and matches nothing.
        return f"v1,{raw.hex()}", "invalid_signature"

    def malformed(self, headers):
        return headers["webhook-signature"].replace(",", ""), "malformed_signature"  # no `v1,`


class SlackP(Provider):
    name = "slack"
    signature_header = "X-Slack-Signature"
    signs_timestamp = True
    library = "slack_sdk.signature.SignatureVerifier.generate_signature / is_valid_request"

    def sign(self, body, secret, ts, content_type=None, **kw):
        signature = SignatureVerifier(secret).generate_signature(timestamp=str(ts), body=body)
        return {
            "X-Slack-Request-Timestamp": str(ts),
            "X-Slack-Signature": signature,
            "Content-Type": content_type or self.content_type,
        }

    def verify(self, body, headers, secret, **kw):
        return SignatureVerifier(secret).is_valid_request(body, headers)

    def bad_encoding(self, headers):
        digest = headers["X-Slack-Signature"].removeprefix("v0=")
        return f"v0={hex_to_b64(digest)}", "malformed_signature"


class TwilioP(Provider):
    name = "twilio"
    signature_header = "X-Twilio-Signature"
    content_type = "application/x-www-form-urlencoded"
    library = (
        "twilio.request_validator.RequestValidator.compute_signature (+ compute_hash for "
        "JSON bodies) / RequestValidator.validate"
    )

    def sign(self, body, secret, ts, url=None, json_body=False, without_port=False, **kw):
        validator = RequestValidator(secret)
        signed_url = remove_port(urlsplit(url)) if without_port else url
        if json_body:
            signature = validator.compute_signature(signed_url, {})
            content_type = "application/json"
        else:
            signature = validator.compute_signature(signed_url, MultiDict.parse(body))
            content_type = self.content_type
        return {
            "X-Twilio-Signature": signature,
            "I-Twilio-Idempotency-Token": fresh(),
            "Content-Type": content_type,
        }

    def verify(self, body, headers, secret, url=None, **kw):
        validator = RequestValidator(secret)
        signature = lower(headers).get("x-twilio-signature")
        if signature is None:
            return False
        is_json = "json" in lower(headers).get("content-type", "")
        params = body.decode() if is_json else MultiDict.parse(body)
        return validator.validate(url, params, signature)

    def bad_encoding(self, headers):
        raw = base64.b64decode(headers["X-Twilio-Signature"])
        # Hex text is valid base64 of other bytes: it decodes, and matches nothing.
        return raw.hex(), "invalid_signature"

    def malformed(self, headers):
        return "not*base64!", "malformed_signature"


class DiscordP(Provider):
    name = "discord"
    signature_header = "X-Signature-Ed25519"
    signs_timestamp = True
    library_checks_time = False  # Ed25519 only; Discord documents no window
    library = "nacl.signing.SigningKey.sign / VerifyKey.verify (PyNaCl)"

    def sign(self, body, secret, ts, **kw):
        signed = SigningKey(bytes.fromhex(secret)).sign(str(ts).encode() + body)
        return {
            "X-Signature-Ed25519": signed.signature.hex(),
            "X-Signature-Timestamp": str(ts),
            "Content-Type": self.content_type,
        }

    def verify(self, body, headers, secret, **kw):
        h = lower(headers)
        if "x-signature-ed25519" not in h or "x-signature-timestamp" not in h:
            return False
        public = SigningKey(bytes.fromhex(secret)).verify_key
        try:
            VerifyKey(bytes(public)).verify(
                h["x-signature-timestamp"].encode() + body, bytes.fromhex(h["x-signature-ed25519"])
            )
            return True
        except Exception:  # BadSignatureError, or a signature that is not hex
            return False

    def bad_encoding(self, headers):
        return hex_to_b64(headers["X-Signature-Ed25519"]), "malformed_signature"


class RazorpayP(Provider):
    name = "razorpay"
    signature_header = "X-Razorpay-Signature"
    library = (
        "razorpay.Client().utility.verify_webhook_signature (verify only; signed with "
        "hmac-sha256 hex as Razorpay documents)"
    )

    def sign(self, body, secret, ts, event_id=None, **kw):
        # razorpay has no public signer: hex HMAC-SHA256 of the raw body, as Razorpay's docs
        # and its tests compute it; verify() below checks it with the library.
        return {
            "X-Razorpay-Signature": hmac256(secret, body).hex(),
            "x-razorpay-event-id": event_id or fresh("evt_"),
            "Content-Type": self.content_type,
        }

    def verify(self, body, headers, secret, **kw):
        signature = lower(headers).get("x-razorpay-signature")
        if signature is None:
            return False
        client = razorpay.Client(auth=("rzp_test_interop", secret))  # no network is used
        try:
            return client.utility.verify_webhook_signature(body.decode(), signature, secret)
        except razorpay.errors.SignatureVerificationError:
            return False

    def bad_encoding(self, headers):
        return hex_to_b64(headers["X-Razorpay-Signature"]), "malformed_signature"


class PaddleP(Provider):
    name = "paddle"
    signature_header = "Paddle-Signature"
    signs_timestamp = True
    library = (
        "paddle_billing.Notifications.Verifier.verify (verify only; signed with its "
        "PaddleSignature.calculate_hmac)"
    )

    def sign(self, body, secret, ts, extra_h1=None, **kw):
        # paddle-python-sdk has no signer; its verifier's own HMAC helper computes h1.
        h1 = PaddleSignature.calculate_hmac(secret, f"{ts}:".encode() + body).hexdigest()
        header = f"ts={ts};h1={h1}" if extra_h1 is None else f"ts={ts};h1={extra_h1};h1={h1}"
        return {"Paddle-Signature": header, "Content-Type": self.content_type}

    def verify(self, body, headers, secret, **kw):
        class Headers(dict):
            def get(self, key, default=None):
                return super().get(key.lower(), default)

        class Request:
            pass

        req = Request()
        req.body = body
        req.headers = Headers(lower(headers))
        try:
            return PaddleVerifier().verify(req, PaddleSecret(secret)) is True
        except (ValueError, ConnectionRefusedError):
            return False

    def bad_encoding(self, headers):
        ts, h1 = headers["Paddle-Signature"].split(";")
        # An `h1` that is not hex matches nothing (every `h1` is tried): invalid, not malformed.
        return f"{ts};h1={hex_to_b64(h1.split('=', 1)[1])}", "invalid_signature"

    def malformed(self, headers):
        return headers["Paddle-Signature"].split(";", 1)[1], "malformed_signature"  # no `ts=`


# No official Python library: a reference implementation, checked against the provider's
# published test vector before it is trusted (see the `reference matches vector` cases).


class GitHubP(Provider):
    name = "github"
    signature_header = "X-Hub-Signature-256"
    library = "no official Python library: reference HMAC checked against GitHub's published vectors"

    def sign(self, body, secret, ts, event="push", **kw):
        return {
            "X-Hub-Signature-256": "sha256=" + hmac256(secret, body).hex(),
            "X-GitHub-Delivery": str(uuid.uuid4()),
            "X-GitHub-Event": event,
            "Content-Type": self.content_type,
        }

    def verify(self, body, headers, secret, **kw):
        got = lower(headers).get("x-hub-signature-256")
        return got is not None and hmac.compare_digest(got, "sha256=" + hmac256(secret, body).hex())

    def bad_encoding(self, headers):
        digest = headers["X-Hub-Signature-256"].removeprefix("sha256=")
        return f"sha256={hex_to_b64(digest)}", "malformed_signature"


class WhatsAppP(GitHubP):
    name = "whatsapp"
    library = (
        "no official Python library: reference HMAC (X-Hub-Signature-256), checked against "
        "GitHub's published vector (Meta publishes none)"
    )

    def sign(self, body, secret, ts, **kw):
        return {
            "X-Hub-Signature-256": "sha256=" + hmac256(secret, body).hex(),
            "Content-Type": self.content_type,
        }


class ShopifyP(Provider):
    name = "shopify"
    signature_header = "X-Shopify-Hmac-Sha256"
    library = "no official Python library: reference HMAC checked against shopify-api's vector"

    def sign(self, body, secret, ts, topic="orders/create", **kw):
        return {
            "X-Shopify-Hmac-Sha256": b64(hmac256(secret, body)),
            "X-Shopify-Webhook-Id": str(uuid.uuid4()),
            "X-Shopify-Topic": topic,
            "X-Shopify-Shop-Domain": "interop.myshopify.com",
            "Content-Type": self.content_type,
        }

    def verify(self, body, headers, secret, **kw):
        got = lower(headers).get("x-shopify-hmac-sha256")
        return got is not None and hmac.compare_digest(got, b64(hmac256(secret, body)))

    def bad_encoding(self, headers):
        raw = base64.b64decode(headers["X-Shopify-Hmac-Sha256"])
        # Hex text is valid base64 of other bytes: it decodes, and matches nothing.
        return raw.hex(), "invalid_signature"

    def malformed(self, headers):
        return "not*base64!", "malformed_signature"


PROVIDERS = {
    p.name: p
    for p in (
        StripeP(),
        GitHubP(),
        StandardWebhooksP(),
        ShopifyP(),
        TwilioP(),
        SlackP(),
        WhatsAppP(),
        DiscordP(),
        RazorpayP(),
        PaddleP(),
    )
}


# ----------------------------------------------------------------------------- the run


class Run:
    def __init__(self, binary: Path, tmp: Path):
        self.binary = binary
        self.tmp = tmp
        self.results: list[tuple[bool, str, str, str]] = []
        self.proc: subprocess.Popen | None = None
        self.sink = CaptureServer(keep=False)
        self.capture = CaptureServer(keep=True)
        self.port = self.admin_port = 0
        example = tomllib.loads(EXAMPLE_CONFIG.read_text(encoding="utf-8"))
        self.example = example
        # One source per provider, as examples/providers.toml has them.
        self.sources = {s["provider"]: s for s in example["sources"] if s["provider"] != "generic"}
        missing = set(PROVIDERS) - set(self.sources)
        if missing:
            raise RuntimeError(f"examples/providers.toml has no source for {sorted(missing)}")
        discord = self.sources["discord"]
        expected_key = SigningKey(bytes.fromhex(DISCORD_SEED_HEX)).verify_key.encode().hex()
        if discord["public_key"] != expected_key:
            raise RuntimeError("examples/providers.toml's Discord key is not RFC 8032's test key")
        self.config_path = tmp / "interop.toml"
        self.log_path = tmp / "gateway.log"

    # --- configuration and the gateway

    def config(self, example: dict) -> dict:
        sources = [dict(s) for s in example["sources"]]
        sources += [
            {
                "name": v["name"],
                "provider": v["provider"],
                "secrets": [v["secret"]],
                "destinations": ["app"],
            }
            for v in VECTOR_SOURCES
        ]
        return {
            "server": {
                "listen": f"127.0.0.1:{self.port}",
                "admin_listen": f"127.0.0.1:{self.admin_port}",
                "admin_token": ADMIN_TOKEN,
            },
            "store": {"url": f"sqlite://{self.tmp / 'interop.db'}"},
            "sources": sources,
            "destinations": [
                {
                    "name": "app",
                    "url": f"http://127.0.0.1:{self.sink.port}/sink",
                    "allow": ["127.0.0.1"],
                },
            ],
        }

    def secret(self, provider: str) -> str:
        if provider == "discord":
            return DISCORD_SEED_HEX
        return self.sources[provider]["secrets"][0]

    def source(self, provider: str) -> str:
        return self.sources[provider]["name"]

    def start(self, attempts: int = 3):
        """Starts the gateway on two free ports. A port found free can be taken before the
        gateway binds it; a gateway that exits early is started again on fresh ports."""
        for attempt in range(1, attempts + 1):
            self.port, self.admin_port = free_port(), free_port()
            self.config_path.write_text(to_toml(self.config(self.example)), encoding="utf-8")
            if self.launch():
                return
            if attempt == attempts:
                raise RuntimeError(f"the gateway exited with {self.proc.returncode}\n{self.log_tail()}")

    def launch(self) -> bool:
        """True once /readyz answers 200; False if the gateway exited first."""
        # The gateway reads HOOKLATCH_* overrides from the environment: none may leak in.
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOOKLATCH_")}
        env["NO_COLOR"] = "1"  # plain log lines in gateway.log
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [str(self.binary), "serve", "--config", str(self.config_path)],
                cwd=self.tmp,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:  # the one bounded readiness poll
            if self.proc.poll() is not None:
                return False
            try:
                if request(self.admin_port, "GET", "/readyz", None, {}).status == 200:
                    return True
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"the gateway was not ready within {READY_TIMEOUT}s\n{self.log_tail()}")

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self.sink.close()
        self.capture.close()

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join("  gateway: " + line for line in text[-lines:])

    # --- reporting

    def record(self, provider: str, case: str, fn):
        try:
            detail = fn() or ""
            ok = True
        except Failure as err:
            ok, detail = False, str(err)
        except Exception as err:  # a bug in the check itself is a failure too
            ok = False
            detail = f"{type(err).__name__}: {err}"
            traceback.print_exc(file=sys.stderr)
        self.results.append((ok, provider, case, detail))
        print(f"{'PASS' if ok else 'FAIL'} {provider} {case} {detail}", flush=True)

    # --- (a): official library signs, the gateway answers

    def post(self, source: str, body: bytes, headers: dict, query: str = "") -> Response:
        return request(self.port, "POST", f"/in/{source}{query}", body, headers)

    def url(self, source: str, query: str = "") -> str:
        return f"http://127.0.0.1:{self.port}/in/{source}{query}"

    def library_agrees(self, p: Provider, body, headers, secret, valid: bool, **kw) -> str:
        """Asks the official verifier (or the reference one) first, so a case proves the
        gateway agrees with it, not only with this script."""
        got = p.verify(body, headers, secret, **kw)
        if got != valid:
            raise Failure(
                f"the library's own verifier says {'valid' if got else 'invalid'}, "
                f"expected {'valid' if valid else 'invalid'}: the check is wrong"
            )
        if valid:
            return "library: valid" + ("" if p.library_checks_time else " (it checks no time)")
        return "library: rejects too"

    def expect_accepted(self, res: Response, count: int = 1) -> str:
        if res.status != 200:
            raise Failure(f"expected 200 accepted, got {res.status} {res.body[:300]!r}")
        doc = res.json()
        events = doc.get("events") or []
        if doc.get("status") != "accepted" or len(events) != count:
            raise Failure(f"expected accepted with {count} event(s), got {doc}")
        if any(e.get("claim") != "new" for e in events):
            raise Failure(f"expected every claim new, got {doc}")
        return f"200 accepted {', '.join(e['key'] for e in events)}"

    def expect_refused(self, res: Response, code: str) -> str:
        if res.status != 401:
            raise Failure(f"expected 401 {code}, got {res.status} {res.body[:300]!r}")
        got = res.json().get("code")
        if got != code:
            raise Failure(f"expected 401 {code}, got 401 {got}")
        return f"401 {code}"

    def expect_reply(self, res: Response, content_type: str, body: bytes | None, what: str) -> str:
        got_type = res.headers.get("content-type", "")
        if res.status != 200 or not got_type.startswith(content_type):
            raise Failure(
                f"expected 200 {content_type} ({what}), got {res.status} {got_type} {res.body[:300]!r}"
            )
        if body is not None and res.body != body:
            if content_type == "application/json" and body and json.loads(body) == res.json():
                return f"200 {what}"
            raise Failure(f"expected {what} {body!r}, got {res.body[:300]!r}")
        return f"200 {what}"

    def signed_cases(self, p: Provider, body_for, accept, sign_kw=None, verify_kw=None, label=""):
        """The standard set for one provider: accepted, then each tampering refused, with the
        official verifier agreeing on each. `body_for(key)` builds a body, `accept(res)`
        checks the gateway's acceptance."""
        sign_kw = sign_kw or {}
        verify_kw = verify_kw or {}
        secret = self.secret(p.name)
        source = self.source(p.name)
        sfx = f" ({label})" if label else ""

        def accepted():
            ts = int(time.time())
            body = body_for(fresh())
            headers = p.sign(body, secret, ts, **sign_kw)
            lib = self.library_agrees(p, body, headers, secret, True, **verify_kw)
            return f"{accept(self.post(source, body, headers))}; {lib}"

        def refused(make, code, library_rejects=True):
            def run():
                body, headers = make()
                lib = self.library_agrees(p, body, headers, secret, not library_rejects, **verify_kw)
                return f"{self.expect_refused(self.post(source, body, headers), code)}; {lib}"

            return run

        def tampered():
            body = body_for(fresh())
            return tamper(body), p.sign(body, secret, int(time.time()), **sign_kw)

        def wrong_secret():
            body = body_for(fresh())
            other = SigningKey.generate().encode().hex() if p.name == "discord" else wrong(p, secret)
            return body, p.sign(body, other, int(time.time()), **sign_kw)

        def stale():
            body = body_for(fresh())
            return body, p.sign(body, secret, int(time.time()) - STALE, **sign_kw)

        def missing():
            body = body_for(fresh())
            headers = p.sign(body, secret, int(time.time()), **sign_kw)
            del headers[p.signature_header]
            return body, headers

        def reencoded(kind):
            def make():
                body = body_for(fresh())
                headers = p.sign(body, secret, int(time.time()), **sign_kw)
                value, _ = p.bad_encoding(headers) if kind == "bad" else p.malformed(headers)
                headers[p.signature_header] = value
                return body, headers

            return make

        self.record(p.name, f"accepted{sfx}", accepted)
        self.record(p.name, f"tampered-body{sfx}", refused(tampered, "invalid_signature"))
        self.record(p.name, f"wrong-secret{sfx}", refused(wrong_secret, "invalid_signature"))
        if p.signs_timestamp:
            # Discord: PyNaCl checks the signature only (Discord documents no window), so the
            # library calls it valid; the window is the gateway's own (README: tolerance).
            self.record(
                p.name,
                f"stale-timestamp{sfx}",
                refused(stale, "stale_timestamp", library_rejects=p.library_checks_time),
            )
        self.record(p.name, f"missing-signature{sfx}", refused(missing, "missing_signature"))
        # The code depends only on the header, so the expected code is found on a sample.
        sample = p.sign(body_for(fresh()), secret, int(time.time()), **sign_kw)
        self.record(p.name, f"bad-encoding{sfx}", refused(reencoded("bad"), p.bad_encoding(sample)[1]))
        if p.malformed(sample) is not None:
            self.record(
                p.name, f"malformed-header{sfx}", refused(reencoded("malformed"), p.malformed(sample)[1])
            )

    def vector_case(self, p: Provider, source: str, vector, what: str, extra_headers: dict):
        secret, body, signature = vector

        def run():
            content_type = "application/json" if body.startswith(b"{") else "text/plain"
            headers = {p.signature_header: signature, "Content-Type": content_type, **extra_headers}
            if not p.verify(body, headers, secret):
                raise Failure("the reference implementation does not reproduce the vector")
            res = self.post(source, body, headers)
            return f"{self.expect_accepted(res)}; vector: {what}"

        self.record(p.name, f"published-vector ({what})", run)

    def direction_a(self):
        def now() -> int:
            return int(time.time())

        # Stripe
        p = PROVIDERS["stripe"]
        self.signed_cases(
            p,
            lambda key: fixture("stripe", "invoice.payment_succeeded.json", "evt_" + key, now()),
            self.expect_accepted,
        )

        def stripe_rotation():
            body = fixture("stripe", "checkout.session.completed.json", "evt_" + fresh(), now())
            ts = now()
            old = stripe.WebhookSignature.generate_signature_header(body.decode(), "whsec_old_secret", ts)
            new = stripe.WebhookSignature.generate_signature_header(body.decode(), self.secret("stripe"), ts)
            header = f"{old},v1={new.split('v1=')[1]}"  # one v1 per active secret
            headers = {"Stripe-Signature": header, "Content-Type": "application/json"}
            lib = self.library_agrees(p, body, headers, self.secret("stripe"), True)
            return f"{self.expect_accepted(self.post(self.source('stripe'), body, headers))}; {lib}"

        self.record("stripe", "accepted (two v1, secret rotation)", stripe_rotation)

        # Standard Webhooks
        p = PROVIDERS["standard-webhooks"]
        self.signed_cases(
            p, lambda key: fixture("standard-webhooks", "invoice.paid.json", key, now()), self.expect_accepted
        )

        def sw_rotation():
            body = fixture("standard-webhooks", "user.created.json", fresh(), now())
            ts, msg_id = now(), fresh("msg_")
            other = "whsec_" + b64(os.urandom(32))
            old = p.sign(body, other, ts, msg_id=msg_id)["webhook-signature"]
            headers = p.sign(body, self.secret(p.name), ts, msg_id=msg_id)
            headers["webhook-signature"] = f"{old} {headers['webhook-signature']}"
            lib = self.library_agrees(p, body, headers, self.secret(p.name), True)
            return f"{self.expect_accepted(self.post(self.source(p.name), body, headers))}; {lib}"

        self.record(p.name, "accepted (two signatures, secret rotation)", sw_rotation)

        def sw_unpadded():
            body = fixture("standard-webhooks", "invoice.paid.json", fresh(), now())
            headers = p.sign(body, UNPADDED_WHSEC, now())
            lib = self.library_agrees(p, body, headers, UNPADDED_WHSEC, True)
            return f"{self.expect_accepted(self.post('svix-unpadded', body, headers))}; {lib}"

        self.record(p.name, "accepted (whsec_ secret without base64 padding)", sw_unpadded)

        # Slack: Events API (JSON), interactivity (form, empty 200), url_verification
        p = PROVIDERS["slack"]
        self.signed_cases(
            p, lambda key: fixture("slack", "app_mention.json", "Ev" + key, now()), self.expect_accepted
        )

        def slack_form():
            body = fixture("slack", "block_actions.form", fresh(), now())
            headers = p.sign(
                body, self.secret("slack"), now(), content_type="application/x-www-form-urlencoded"
            )
            lib = self.library_agrees(p, body, headers, self.secret("slack"), True)
            res = self.post(self.source("slack"), body, headers)
            return f"{self.expect_reply(res, 'text/plain', b'', 'empty')}; {lib}"

        self.record("slack", "accepted (block_actions form: empty 200)", slack_form)

        def slack_challenge():
            challenge = fresh()
            body = json.dumps({"token": "x", "challenge": challenge, "type": "url_verification"}).encode()
            headers = p.sign(body, self.secret("slack"), now())
            lib = self.library_agrees(p, body, headers, self.secret("slack"), True)
            res = self.post(self.source("slack"), body, headers)
            want = json.dumps({"challenge": challenge}).encode()
            return f"{self.expect_reply(res, 'application/json', want, 'challenge')}; {lib}"

        self.record("slack", "handshake (url_verification)", slack_challenge)

        # Twilio: form (inbound message, status callback), JSON with bodySHA256, port variant
        p = PROVIDERS["twilio"]

        def twiml(res: Response) -> str:
            detail = self.expect_reply(res, "text/xml", None, "TwiML")
            if b"<Response></Response>" not in res.body:
                raise Failure(f"expected empty TwiML, got {res.body[:300]!r}")
            return detail + " (empty)"

        src = self.source("twilio")
        self.signed_cases(
            p,
            lambda key: fixture("twilio", "message.inbound.form", key, now()),
            twiml,
            sign_kw={"url": self.url(src)},
            verify_kw={"url": self.url(src)},
            label="form",
        )

        def twilio_status():
            body = fixture("twilio", "message.status.delivered.form", fresh(), now())
            headers = p.sign(body, self.secret("twilio"), now(), url=self.url(src))
            lib = self.library_agrees(p, body, headers, self.secret("twilio"), True, url=self.url(src))
            return f"{twiml(self.post(src, body, headers))}; {lib}"

        self.record("twilio", "accepted (status callback form)", twilio_status)

        def twilio_without_port():
            body = fixture("twilio", "message.inbound.form", fresh(), now())
            headers = p.sign(body, self.secret("twilio"), now(), url=self.url(src), without_port=True)
            lib = self.library_agrees(p, body, headers, self.secret("twilio"), True, url=self.url(src))
            return f"{twiml(self.post(src, body, headers))}; {lib}"

        self.record("twilio", "accepted (signed over the URL without its port)", twilio_without_port)

        def json_body(key: str) -> bytes:
            return json.dumps(
                {"MessageSid": "SM" + key, "MessageStatus": "delivered", "AccountSid": "AC" + "0" * 32}
            ).encode()

        # JSON bodies: the body's SHA-256 goes into the signed URL (validator.compute_hash).
        def twilio_json(kind: str):
            def run():
                secret = self.secret("twilio")
                body = json_body(fresh())
                query = "?bodySHA256=" + RequestValidator(secret).compute_hash(body.decode())
                url = self.url(src, query)
                headers = p.sign(body, secret, now(), url=url, json_body=True)
                if kind == "accepted":
                    lib = self.library_agrees(p, body, headers, secret, True, url=url)
                    return f"{twiml(self.post(src, body, headers, query))}; {lib}"
                body = tamper(body)
                lib = self.library_agrees(p, body, headers, secret, False, url=url)
                return (
                    f"{self.expect_refused(self.post(src, body, headers, query), 'invalid_signature')}; {lib}"
                )

            return run

        self.record("twilio", "accepted (JSON body, bodySHA256)", twilio_json("accepted"))
        self.record("twilio", "tampered-body (JSON body, bodySHA256)", twilio_json("tampered"))

        # Discord: PING -> PONG, command -> deferred 5, component -> deferred 6
        p = PROVIDERS["discord"]

        def deferred(kind: int):
            def check(res: Response) -> str:
                want = json.dumps({"type": kind}).encode()
                return self.expect_reply(res, "application/json", want, f'{{"type":{kind}}} deferred')

            return check

        def snowflake(key: str) -> str:
            return str(int(key[:15], 16))

        self.signed_cases(
            p,
            lambda key: fixture("discord", "application_command.book.json", snowflake(key), now()),
            deferred(5),
            label="application_command",
        )

        def discord_reply(name, kind, what):
            def run():
                if name == "ping":
                    body = json.dumps(
                        {"id": snowflake(fresh()), "application_id": "1", "type": 1, "version": 1}
                    ).encode()
                else:
                    body = fixture("discord", name, snowflake(fresh()), now())
                headers = p.sign(body, self.secret("discord"), now())
                lib = self.library_agrees(p, body, headers, self.secret("discord"), True)
                res = self.post(self.source("discord"), body, headers)
                want = json.dumps({"type": kind}).encode()
                return f"{self.expect_reply(res, 'application/json', want, what)}; {lib}"

            return run

        self.record(
            "discord",
            "accepted (message_component: deferred 6)",
            discord_reply("message_component.json", 6, '{"type":6} deferred'),
        )
        self.record("discord", "handshake (PING: PONG)", discord_reply("ping", 1, '{"type":1} PONG'))

        # Razorpay
        p = PROVIDERS["razorpay"]
        self.signed_cases(
            p, lambda key: fixture("razorpay", "payment.captured.json", key, now()), self.expect_accepted
        )

        # Paddle
        p = PROVIDERS["paddle"]
        self.signed_cases(
            p,
            lambda key: fixture("paddle", "transaction.completed.json", "evt_" + key, now()),
            self.expect_accepted,
        )

        def paddle_rotation():
            body = fixture("paddle", "subscription.created.json", "evt_" + fresh(), now())
            ts = now()
            old = PaddleSignature.calculate_hmac("pdl_ntfset_old", f"{ts}:".encode() + body).hexdigest()
            headers = p.sign(body, self.secret("paddle"), ts, extra_h1=old)
            lib = self.library_agrees(p, body, headers, self.secret("paddle"), True)
            return f"{self.expect_accepted(self.post(self.source('paddle'), body, headers))}; {lib}"

        self.record("paddle", "accepted (two h1, secret rotation)", paddle_rotation)

        # GitHub, Shopify, WhatsApp: published vectors through the gateway, then the standard
        # set with the reference implementation those vectors vouch for.
        p = PROVIDERS["github"]

        def delivery() -> dict:
            return {"X-GitHub-Delivery": str(uuid.uuid4()), "X-GitHub-Event": "ping"}

        self.vector_case(p, "github-vector-docs", GITHUB_DOCS_VECTOR, "GitHub docs", delivery())
        self.vector_case(
            p, "github-vector-octokit", GITHUB_OCTOKIT_VECTOR, "octokit/webhooks-methods", delivery()
        )
        self.signed_cases(p, lambda key: fixture("github", "push.json", key, now()), self.expect_accepted)

        p = PROVIDERS["shopify"]
        self.vector_case(
            p,
            "shopify-vector",
            SHOPIFY_VECTOR,
            "shopify-api validate.test.ts",
            {"X-Shopify-Webhook-Id": str(uuid.uuid4()), "X-Shopify-Topic": "orders/create"},
        )
        self.signed_cases(
            p, lambda key: fixture("shopify", "orders__create.json", key, now()), self.expect_accepted
        )

        p = PROVIDERS["whatsapp"]
        self.vector_case(p, "whatsapp-vector", GITHUB_OCTOKIT_VECTOR, "octokit's X-Hub-Signature-256", {})
        self.signed_cases(
            p,
            lambda key: fixture("whatsapp", "message.text.json", "wamid." + key, now()),
            self.expect_accepted,
        )

        def whatsapp_batch():
            body = fixture("whatsapp", "batch.json", fresh(), now())
            headers = p.sign(body, self.secret("whatsapp"), now())
            lib = self.library_agrees(p, body, headers, self.secret("whatsapp"), True)
            return (
                f"{self.expect_accepted(self.post(self.source('whatsapp'), body, headers), count=5)}; {lib}"
            )

        self.record("whatsapp", "accepted (batch of 5 items)", whatsapp_batch)

    # --- (b): `hooklatch send` signs, the official library verifies

    def direction_b(self):
        listing = subprocess.run(
            [str(self.binary), "send", "--list"],
            capture_output=True,
            text=True,
            timeout=SEND_TIMEOUT,
            stdin=subprocess.DEVNULL,
        )
        catalog = [line.split() for line in listing.stdout.splitlines() if line.strip()]
        if listing.returncode != 0 or not catalog:
            self.record(
                "send", "--list", lambda: fail(f"exited {listing.returncode}: {listing.stderr.strip()}")
            )
            return
        listed = {provider for provider, _ in catalog}
        if listed != set(PROVIDERS):
            self.record(
                "send",
                "--list covers every provider",
                lambda: fail(f"listed {sorted(listed)}, checked {sorted(PROVIDERS)}"),
            )
        for provider, event in catalog:
            self.record(
                provider, f"send-verifies ({event})", lambda p=provider, e=event: self.send_case(p, e)
            )
        self.record(
            "standard-webhooks",
            "send-verifies (invoice.paid, whsec_ secret without base64 padding)",
            lambda: self.send_case("standard-webhooks", "invoice.paid", UNPADDED_WHSEC),
        )

    def send_case(self, provider: str, event: str, secret: str | None = None) -> str:
        p = PROVIDERS.get(provider)
        if p is None:
            raise Failure(f"no official-library check for provider {provider}")
        secret = secret or self.secret(provider)
        self.capture.drain()
        to = f"http://127.0.0.1:{self.capture.port}/in/{self.source(provider)}"
        sent = subprocess.run(
            [str(self.binary), "send", provider, "--event", event, "--secret", secret, "--to", to],
            capture_output=True,
            text=True,
            timeout=SEND_TIMEOUT,
            stdin=subprocess.DEVNULL,
        )
        if sent.returncode != 0:
            raise Failure(f"hooklatch send exited {sent.returncode}: {sent.stderr.strip()}")
        got = self.capture.take()
        if got.url != to:
            raise Failure(f"captured {got.url}, sent to {to}")
        if not p.verify(got.body, got.headers, secret, url=got.url):
            raise Failure(f"{p.library} refuses it: headers {got.headers}")
        # The same capture, one byte changed, must not verify: the check has teeth.
        if p.verify(tamper(got.body), got.headers, secret, url=got.url):
            raise Failure("a tampered copy verifies too: the check is wrong")
        return f"verified by {p.library}"


def fail(detail: str):
    raise Failure(detail)


def wrong(p: Provider, secret: str) -> str:
    """Another secret of the same shape."""
    if p.name == "standard-webhooks":
        return "whsec_" + b64(os.urandom(24))
    return secret + "-wrong"


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    # SIGTERM (a harness giving up) unwinds like an error, so the gateway is still stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    binary = Path(sys.argv[1]).resolve()
    if not os.access(binary, os.X_OK):
        print(f"not an executable: {binary}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="hooklatch-interop-") as tmp:
        try:
            run = Run(binary, Path(tmp))
        except (RuntimeError, OSError, ValueError) as err:
            print(f"FAIL setup config {err}", flush=True)
            print("0 passed, 1 failed", flush=True)
            return 1
        try:
            try:
                run.start()
            except RuntimeError as err:
                run.results.append((False, "gateway", "start", str(err)))
                print(f"FAIL gateway start {err}", flush=True)
            else:
                print(f"# gateway on 127.0.0.1:{run.port}, admin 127.0.0.1:{run.admin_port}", flush=True)
                run.direction_a()
                run.direction_b()
                if run.proc.poll() is not None:
                    run.results.append((False, "gateway", "alive", f"exited {run.proc.returncode}"))
                    print(f"FAIL gateway alive exited {run.proc.returncode}\n{run.log_tail()}", flush=True)
        finally:
            run.stop()
        failed = sum(1 for ok, *_ in run.results if not ok)
        passed = len(run.results) - failed
        if failed:
            print(run.log_tail(), flush=True)
        print(f"{passed} passed, {failed} failed", flush=True)
        return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
