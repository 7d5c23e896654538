"""How daemons trust each other on gRPC: a swarm key seals every request and response
(moshpitd/auth.py), and TLS, when configured, encrypts the channel and checks certificates.

Sealing lives in the (de)serializers, so it covers every message of every call whatever the
handler, and a request that fails to open never reaches a handler: gRPC answers it with an
error status (INTERNAL, "Exception deserializing request").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from cryptography import x509
from google.protobuf.message import Message

from moshpitd.auth import AuthError, ReplayCache, SwarmKey

log = logging.getLogger(__name__)

M = TypeVar("M")


@dataclass(frozen=True)
class TLSFiles:
    cert: bytes
    key: bytes
    ca: bytes
    server_name: str = ""  # name to expect in peers' certificates; "" = the dialled host

    @classmethod
    def load(cls, cert: str, key: str, ca: str, server_name: str = "") -> TLSFiles:
        def read(path: str, what: str) -> bytes:
            try:
                with open(path, "rb") as f:
                    data = f.read(1 << 20)
            except OSError as exc:
                raise ValueError(f"cannot read TLS {what} {path}: {exc.strerror}") from None
            if b"-----BEGIN" not in data:
                raise ValueError(f"TLS {what} {path} is not PEM")
            return data
        pem = read(cert, "certificate")
        try:  # the peer key signs its digest in every join (matchmaking/signing.py)
            x509.load_pem_x509_certificate(pem)
        except ValueError as exc:
            raise ValueError(f"TLS certificate {cert} cannot be read: {exc}") from None
        return cls(pem, read(key, "key"), read(ca, "CA bundle"), server_name)


class Security:
    def __init__(self, auth: SwarmKey | None = None, tls: TLSFiles | None = None) -> None:
        self.auth = auth
        self.tls = tls
        self.replay = ReplayCache()
        self.rejected = 0

    # --- channels ------------------------------------------------------------------------
    def server_credentials(self) -> grpc.ServerCredentials | None:
        if self.tls is None:
            return None
        # mutual TLS: a peer must present a certificate from our CA
        return grpc.ssl_server_credentials([(self.tls.key, self.tls.cert)],
                                           root_certificates=self.tls.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if self.tls is None:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self.tls.ca,
                                            private_key=self.tls.key,
                                            certificate_chain=self.tls.cert)

    def channel_options(self) -> list[tuple[str, Any]]:
        if self.tls is not None and self.tls.server_name:
            return [("grpc.ssl_target_name_override", self.tls.server_name)]
        return []

    # --- messages ------------------------------------------------------------------------
    def server_side(self, method: str, request: type[Message], response: type[Message]
                    ) -> dict[str, Callable[..., Any]]:
        """(De)serializers for a handler of `method`: requests are opened (with the nonce
        cache: a replayed request is refused), responses sealed."""
        return {"request_deserializer": self._opener(method.encode(), request.FromString,
                                                      self.replay),
                "response_serializer": self._sealer(method.encode() + b"/response",
                                                    response.SerializeToString)}

    def client_side(self, method: str, request: type[Message], response: type[Message]
                    ) -> dict[str, Callable[..., Any]]:
        """(De)serializers for calls of `method`. Responses travel on the stream our own
        sealed request opened: the tag and time window suffice, no nonce cache."""
        return {"request_serializer": self._sealer(method.encode(), request.SerializeToString),
                "response_deserializer": self._opener(method.encode() + b"/response",
                                                      response.FromString, None)}

    def _sealer(self, context: bytes, to_bytes: Callable[[Any], bytes]
                ) -> Callable[[Any], bytes]:
        auth = self.auth
        if auth is None:
            return to_bytes
        return lambda msg: auth.seal(b"grpc", context, to_bytes(msg))

    def _opener(self, context: bytes, from_bytes: Callable[[bytes], M],
                replay: ReplayCache | None) -> Callable[[bytes], M]:
        auth = self.auth
        if auth is None:
            return from_bytes

        def open_message(data: bytes) -> M:
            try:
                return from_bytes(auth.open(b"grpc", context, data, replay))
            except AuthError as exc:
                self.rejected += 1
                # debug only: anyone can send these; moshpitd_auth_rejected_total counts them
                log.debug("refused an unauthenticated %s message: %s", context.decode(), exc)
                raise
        return open_message


def load_secrets(swarm_key_file: str, tls_cert: str, tls_key: str, tls_ca: str,
                 tls_server_name: str) -> tuple[SwarmKey | None, TLSFiles | None]:
    """Read the key and certificate files named in the settings; ValueError says which."""
    key = SwarmKey.from_file(swarm_key_file) if swarm_key_file else None
    tls = TLSFiles.load(tls_cert, tls_key, tls_ca, tls_server_name) if tls_cert else None
    return key, tls
