"""The daemon's peer key: an Ed25519 key pair whose public half is who this daemon is.

The swarm key (auth.py) says a daemon is a member; the peer key says which member. A peer id is
the first 20 bytes of SHA-256 of the raw 32-byte public key, so anyone holding a public key can
check that it belongs to an id, and nobody can pick an id without holding its private key.
The id is also the daemon's Kademlia node id (20 bytes, like Kademlia's own).

The private key lives in a file (PKCS#8 PEM, as `openssl genpkey -algorithm ed25519` writes
it) that is created, mode 0600, on first start: the identity survives restarts. A file that
others may read, or that does not hold an Ed25519 key, stops the daemon at start. A running
daemon holds an exclusive lock on its file (`KeyFileLock`): two daemons with one key would be
one peer to the swarm, and every round of both would fail with nothing naming the cause.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import stat
from collections.abc import Callable, Mapping
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

PEER_ID_BYTES = 20
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
MAX_KEY_FILE = 1 << 16

KEY_FILE_NAME = "peer.key"
SYSTEM_STATE_DIR = "/var/lib/moshpitd"

__all__ = ["PEER_ID_BYTES", "PUBLIC_KEY_BYTES", "SIGNATURE_BYTES", "IdentityError", "KeyFileLock",
           "PeerKey", "default_key_file", "peer_id_of", "verify"]


class IdentityError(ValueError):
    """The peer key file cannot be used; the message says which file and what to do."""


def peer_id_of(public: bytes) -> bytes:
    return hashlib.sha256(public).digest()[:PEER_ID_BYTES]


# A simulated swarm (moshpitd/virtual/) runs a thousand daemons in one process, and each of
# them checks the same signed records: it sets this memo of results (verification is a pure
# function, so every node still gets the answer its own check would give).
MEMO: dict[bytes, bool] | None = None
MEMO_MAX = 1 << 20


def verify(public: bytes, signature: bytes, data: bytes) -> bool:
    """Whether `signature` is `public`'s signature of `data` (False for a malformed key)."""
    if MEMO is not None:
        key = hashlib.blake2b(public + signature + data, digest_size=16).digest()
        known = MEMO.get(key)
        if known is None:
            if len(MEMO) >= MEMO_MAX:
                MEMO.clear()
            known = MEMO[key] = _verify(public, signature, data)
        return known
    return _verify(public, signature, data)


def _verify(public: bytes, signature: bytes, data: bytes) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, data)
    except (InvalidSignature, ValueError):
        return False
    return True


class PeerKey:
    def __init__(self, private: Ed25519PrivateKey) -> None:
        self._private = private
        self.public = private.public_key().public_bytes(serialization.Encoding.Raw,
                                                        serialization.PublicFormat.Raw)
        self.peer_id = peer_id_of(self.public)

    @classmethod
    def generate(cls) -> PeerKey:
        """A key that lives as long as the process: for tests and in-process nodes."""
        return cls(Ed25519PrivateKey.generate())

    def sign(self, data: bytes) -> bytes:
        return self._private.sign(data)

    def pem(self) -> bytes:
        return self._private.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption())

    @classmethod
    def load(cls, path: str) -> PeerKey:
        """The key in an existing file, refused if others may read it or it is malformed."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise IdentityError(f"cannot read peer key file {path}: {exc.strerror}") from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise IdentityError(f"peer key file {path} is not a regular file")
            if st.st_mode & 0o077:
                raise IdentityError(
                    f"peer key file {path} has mode {stat.S_IMODE(st.st_mode):04o}: it is this "
                    f"daemon's identity and must be readable by its owner only (chmod 600 {path})")
            data = f.read(MAX_KEY_FILE + 1)
        try:
            private = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as exc:
            raise IdentityError(
                f"peer key file {path} does not hold an unencrypted PEM private key ({exc}); "
                "move it away and the daemon makes a new identity at its next start") from None
        if not isinstance(private, Ed25519PrivateKey):
            raise IdentityError(f"peer key file {path} holds a {type(private).__name__}, not an "
                                "Ed25519 key")
        return cls(private)

    @classmethod
    def load_or_create(cls, path: str) -> PeerKey:
        """The key in `path`, made there (mode 0600, directory 0700 if missing) on first use."""
        if os.path.lexists(path):
            return cls.load(path)
        key = cls.generate()
        directory = os.path.dirname(os.path.abspath(path))
        try:
            if not os.path.isdir(directory):
                os.makedirs(directory, mode=0o700)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:  # another process made it first: that one is the identity
            if os.path.lexists(path):
                return cls.load(path)
            raise IdentityError(f"cannot create peer key file {path}: {directory} is not a "
                                "directory (set peer_key_file to another path)") from None
        except OSError as exc:
            raise IdentityError(
                f"cannot create peer key file {path}: {exc.strerror} (set peer_key_file to a "
                "path this user may write, e.g. in the daemon's state directory)") from None
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(key.pem())
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        return key


def _may_write(directory: str) -> bool:
    """Whether this user may make files in `directory`, or make it (its parent writable)."""
    target = directory if os.path.isdir(directory) else os.path.dirname(directory)
    return os.access(target, os.W_OK | os.X_OK)


def default_key_file(env: Mapping[str, str] | None = None, system_dir: str = SYSTEM_STATE_DIR,
                     may_write: Callable[[str], bool] = _may_write) -> str:
    """Where a daemon keeps its key when peer_key_file is empty, by who runs it: systemd's
    state directory; else the system's, where this user may write it (root, or the Kubernetes
    manifest's mounted volume); else the user's own state directory. A user's daemons thus
    never fall back on one shared path that only root could have made."""
    env = os.environ if env is None else env
    if state := env.get("STATE_DIRECTORY", "").split(":")[0]:
        return os.path.join(state, KEY_FILE_NAME)
    if may_write(system_dir):
        return os.path.join(system_dir, KEY_FILE_NAME)
    base = env.get("XDG_STATE_HOME") or os.path.join(
        env.get("HOME") or str(Path.home()), ".local", "state")
    return os.path.join(base, "moshpitd", KEY_FILE_NAME)


def _lock_holder(st: os.stat_result) -> int | None:
    """The pid holding a flock on the file with this inode, read from /proc/locks (Linux)."""
    wanted = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            for line in f:
                fields = line.split()
                # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" (blocked waiters: "->")
                if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == wanted:
                    return int(fields[4])
    except (OSError, ValueError):
        pass
    return None


class KeyFileLock:
    """An exclusive flock on the key file, held by an open descriptor for the daemon's life.
    The kernel drops it when the process ends, however it ends, so a crash leaves no stale
    lock behind."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self._fd: int | None = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise IdentityError(f"cannot open peer key file {path}: {exc.strerror}") from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _lock_holder(os.fstat(self._fd))
            self.release()
            who = f" (pid {holder})" if holder is not None and holder != os.getpid() else ""
            raise IdentityError(
                f"peer key file {path} is in use by another running daemon{who}: two daemons "
                "with one key are one peer to the swarm; give each its own peer_key_file"
            ) from None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
